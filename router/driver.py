"""The router's side of a run: start workers, then for every step send commands, collect
results, combine the global gradient norm, and publish metrics; commit the final checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import time
from pathlib import Path

from dyad.router.launcher import Launcher, WorkerSpec
from dyad.router.run import Run, worker_key
from dyad.router.steps import StepPlanner, step_command
from dyad.optim import clip_scale
from dyad.wire import pb

log = logging.getLogger(__name__)
_POLL_S = 0.2


class RunAborted(RuntimeError):
    def __init__(self, message: str, state: int = pb.RUN_STATE_FAILED):
        super().__init__(message)
        self.state = state


class RunDriver:
    def __init__(self, run: Run, launcher: Launcher, router_address: str, dataset):
        self.run = run
        self.launcher = launcher
        self.router_address = router_address
        self.config = run.config
        self.out_dir = Path(run.config.out_dir)
        self.planner = StepPlanner(run.config, dataset)

    def __call__(self) -> None:
        state, message = pb.RUN_STATE_SUCCEEDED, ""
        try:
            self._start_workers()
            self.run.set_state(pb.RUN_STATE_RUNNING)
            with open(self.out_dir / "metrics.jsonl", "a") as metrics_file:
                for step in range(self.config.train.steps):
                    self._check_stop()
                    metrics = self._train_step(step)
                    metrics_file.write(json.dumps(_metrics_record(metrics)) + "\n")
                    metrics_file.flush()
                    self.run.record_step(metrics)
            self._save_checkpoint(self.config.train.steps)
        except RunAborted as error:
            state, message = error.state, str(error)
        except Exception as error:  # noqa: BLE001 - the run fails, the router lives on
            log.exception("run %s failed", self.run.run_id)
            state, message = pb.RUN_STATE_FAILED, f"{type(error).__name__}: {error}"
        finally:
            self.run.send(pb.WorkerCommand(stop=pb.StopCommand(reason=message or "done")))
            self.launcher.stop()
            self.run.set_state(state, message)

    # ------------------------------------------------------------------ phases

    def _start_workers(self) -> None:
        specs = [
            WorkerSpec(pool, rank)
            for pool, size in self.run.pool_sizes.items()
            for rank in range(size)
        ]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.launcher.start(self.run.run_id, self.router_address, specs, self.out_dir / "logs")

        def should_abort() -> bool:
            return self.run.stop_requested.is_set() or bool(self.launcher.dead())

        if not self.run.wait_for_workers(self.config.router.start_timeout_s, should_abort):
            self._check_stop()
            self._check_alive()
            raise RunAborted(
                f"workers did not register within router.start_timeout_s="
                f"{self.config.router.start_timeout_s}"
            )
        peers = [
            pb.Peer(
                worker=pb.WorkerId(pool=_pool_enum(pool), rank=rank), data_address=channel.address
            )
            for (pool, rank), channel in sorted(self.run.registered().items())
        ]
        self.run.send(pb.WorkerCommand(setup=pb.SetupCommand(peers=peers)))

    def _train_step(self, step: int) -> pb.StepMetrics:
        started = time.perf_counter()
        spec = self.planner.next(step)
        plan = self.planner.boundary_plan(spec)
        command = step_command(spec, plan, self.config.encoder.tokens_per_image)
        self.run.send(pb.WorkerCommand(step=command))
        results = self._collect("step", step)

        total_sq = sum(r.grad_sq_norm for r in results.values())
        grad_scale = clip_scale(total_sq, self.config.train.grad_clip)
        self.run.send(pb.WorkerCommand(apply=pb.ApplyCommand(step=step, grad_scale=grad_scale)))
        self._collect("apply", step)

        llm = [r for (pool, _), r in results.items() if pool == "llm"]
        encoder = [r for (pool, _), r in results.items() if pool == "encoder"]
        lm_loss = sum(r.lm_loss_sum for r in llm)
        aux_loss = sum(r.aux_loss for r in llm)
        elapsed = time.perf_counter() - started
        return pb.StepMetrics(
            step=step,
            loss=lm_loss + aux_loss,
            lm_loss=lm_loss,
            aux_loss=aux_loss,
            tokens=spec.tokens,
            target_tokens=spec.target_tokens,
            grad_norm=math.sqrt(total_sq),
            lr=spec.lr,
            step_time_s=elapsed,
            tokens_per_s=spec.tokens / elapsed,
            boundary_bytes_fwd=sum(r.boundary_bytes_sent for r in encoder),
            boundary_bytes_bwd=sum(r.boundary_bytes_sent for r in llm),
            encoder_wait_s=max((r.boundary_wait_s for r in encoder), default=0.0),
            llm_wait_s=max((r.boundary_wait_s for r in llm), default=0.0),
            encoder_imbalance=plan.encoder_imbalance,
        )

    def _save_checkpoint(self, step: int) -> None:
        path = self.out_dir / "checkpoints" / f"step_{step:08d}"
        path.mkdir(parents=True, exist_ok=True)
        self.run.send(pb.WorkerCommand(save=pb.SaveCommand(step=step, path=str(path))))
        self._collect("save", step)
        manifest = {
            "run_id": self.run.run_id,
            "step": step,
            "files": sorted(f.name for f in path.iterdir() if f.suffix == ".pt"),
            "config": self.run.config_yaml,
        }
        # The manifest is written last and atomically: a checkpoint without one is incomplete.
        tmp = path / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, path / "manifest.json")

    # ------------------------------------------------------------------ waiting

    def _collect(self, kind: str, step: int) -> dict[tuple[str, int], object]:
        """One `kind` result from every worker for `step`, or abort with the reason."""
        pending = set(self.run.registered())
        results = {}
        while pending:
            self._check_stop()
            self._check_alive()
            try:
                result = self.run.results.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            key = worker_key(result.worker)
            if result.WhichOneof("result") == "error":
                raise RunAborted(f"worker {key[0]}/{key[1]} failed: {result.error}")
            payload = getattr(result, kind) if result.WhichOneof("result") == kind else None
            if payload is not None and payload.step == step and key in pending:
                results[key] = payload
                pending.discard(key)
        return results

    def _check_stop(self) -> None:
        if self.run.stop_requested.is_set():
            raise RunAborted("stopped by the client", pb.RUN_STATE_STOPPED)

    def _check_alive(self) -> None:
        dead = self.launcher.dead()
        if dead:
            spec, reason = dead[0]
            raise RunAborted(f"worker {spec.pool}/{spec.rank} {reason}")
        deadline = time.monotonic() - self.config.router.worker_timeout_s
        for (pool, rank), channel in self.run.registered().items():
            if channel.last_seen < deadline:
                raise RunAborted(
                    f"worker {pool}/{rank} silent for more than "
                    f"router.worker_timeout_s={self.config.router.worker_timeout_s}"
                )


def _pool_enum(pool: str) -> int:
    return {"encoder": pb.POOL_ENCODER, "llm": pb.POOL_LLM}[pool]


def _metrics_record(metrics: pb.StepMetrics) -> dict:
    fields = (
        "step", "loss", "lm_loss", "aux_loss", "tokens", "target_tokens", "grad_norm", "lr",
        "step_time_s", "tokens_per_s", "boundary_bytes_fwd", "boundary_bytes_bwd",
        "encoder_wait_s", "llm_wait_s", "encoder_imbalance",
    )
    return {name: getattr(metrics, name) for name in fields}
