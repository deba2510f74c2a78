"""Running a job end to end from the client's side: start a local router (or use a given one),
submit the config, follow the run's metrics with its progress, and report the outcome.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import grpc
from tqdm import tqdm

from dyad import config as config_lib
from dyad.app.client import RouterClient, local_router
from dyad.config import RunConfig
from dyad.router.checkpoints import checkpoint_dir
from dyad.router.run import pool_sizes
from dyad.wire import as_dict, pb


@dataclass
class JobResult:
    info: pb.RunInfo
    metrics: list[dict]
    evaluations: list[dict] = field(default_factory=list)  # the run's held-out evaluations, by step (`eval:`)

    @property
    def succeeded(self) -> bool:
        return self.info.state == pb.RUN_STATE_SUCCEEDED

    def final_checkpoint(self) -> Path:
        return checkpoint_dir(self.info.out_dir, self.info.total_steps)


def run_job(
    config: RunConfig,
    *,
    router: RouterClient | None = None,
    progress: bool = True,
    stop_after: int | None = None,
) -> JobResult:
    """Run `config` on `router` (the caller's client, left open), else on a local router.
    `stop_after`: stop the run once that step is done; it ends stopped, without the final
    checkpoint (benchmarks measure steps, and a checkpoint gathers every tensor at full size).
    A run the router refuses leaves no output directory behind unless it was there before."""
    out_dir = Path(config.out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(config_lib.to_yaml(config))
    connected = contextlib.nullcontext(router) if router is not None else local_router(out_dir / "logs" / "router.log")
    with connected as client:
        try:
            info = client.start_run(config_lib.to_yaml(config))
        except grpc.RpcError:
            if created:  # the router started nothing (a local one's log says no more than the error)
                shutil.rmtree(out_dir, ignore_errors=True)
            raise
        return _follow(client, info, config, progress, stop_after)


def _follow(
    client: RouterClient, info: pb.RunInfo, config: RunConfig, progress: bool, stop_after: int | None
) -> JobResult:
    shown = Progress(info.total_steps, enabled=progress)
    sizes = " + ".join(f"{size} {pool}" for pool, size in pool_sizes(config).items())
    shown.note(f"run {info.run_id}: starting its workers ({sizes})...")
    by_step: dict[int, dict] = {}  # a recovery trains steps again: the last record counts
    evaluations: dict[int, dict] = {}
    try:
        for event in client.watch(info.run_id):
            kind = event.WhichOneof("event")
            if kind == "step":
                record = as_dict(event.step)
                by_step[record["step"]] = record
                shown.step(record)
                if record["skipped"]:
                    shown.note(f"step {record['step']} skipped: loss {record['loss']}, grad_norm {record['grad_norm']}")
                if record["step"] == stop_after:
                    _stop_unless_finished(client, info.run_id)
            elif kind == "evaluation":
                evaluations[event.evaluation.step] = as_dict(event.evaluation)
                shown.note(describe_evaluation(event.evaluation))
            elif kind == "notice":
                notice = event.notice
                if notice.kind != "checkpoint":
                    shown.note(f"{notice.kind} at step {notice.step}: {notice.message}")
            elif kind == "finished":
                info = event.finished
    except KeyboardInterrupt:
        client.stop_run(info.run_id)
        raise
    finally:
        shown.close()
    metrics = [by_step[step] for step in sorted(by_step)]
    return JobResult(info=client.get_run(info.run_id), metrics=metrics,
                     evaluations=[evaluations[step] for step in sorted(evaluations)])


def describe_evaluation(metrics: pb.EvalMetrics) -> str:
    accuracy = f", accuracy {metrics.accuracy:.3f} on {metrics.answered}" if metrics.answered else ""
    return (f"step {metrics.step}: held-out loss {metrics.loss:.4f} over {metrics.samples} samples"
            f"{accuracy} ({metrics.seconds:.1f}s)")


class Progress:
    """A followed run's progress on `stream` (stderr). On a terminal, a bar that starts at the
    first step the run reports (a resumed run's, not 0), so that its rate and ETA count only the
    steps trained since. Elsewhere (a log file, CI) a plain line every tenth of the run or
    `every_s` seconds, whichever comes first, and at its last step: not a bar redrawn per step."""

    def __init__(self, total_steps: int, *, enabled: bool = True, stream: TextIO | None = None,
                 every_s: float = 30.0):
        self.total, self.enabled, self.every_s = total_steps, enabled, every_s
        self.stream = stream or sys.stderr
        self.every_steps = max(1, math.ceil(total_steps / 10))
        self.terminal = enabled and self.stream.isatty()
        self.bar: tqdm | None = None
        self._first: tuple[int, float] | None = None  # (steps done, time) at the first report
        self._logged: tuple[int, float] = (0, 0.0)  # the same at the last plain line

    def note(self, text: str) -> None:
        if self.terminal:
            tqdm.write(text, file=self.stream)
        elif self.enabled:
            print(text, file=self.stream, flush=True)

    def step(self, record: dict) -> None:
        done, now = record["step"] + 1, time.monotonic()
        first = self._first is None
        if first:
            self._first = (done, now)
        if self.terminal:
            self._draw(done, record, first)
        elif self.enabled and (first or done >= self.total or now - self._logged[1] >= self.every_s
                               or done // self.every_steps > self._logged[0] // self.every_steps):
            self._logged = (done, now)
            self.note(self._line(done, record, now))

    def _draw(self, done: int, record: dict, first: bool) -> None:
        if first:
            self.bar = tqdm(total=self.total, initial=done, desc="train", unit="step", file=self.stream)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        else:  # a recovery trains steps again
            self.bar.n = done
            self.bar.refresh()

    def _line(self, done: int, record: dict, now: float) -> str:
        line = (f"step {done}/{self.total} ({100 * done // self.total}%) loss {record['loss']:.4f} "
                f"tokens/s {record['tokens_per_s']:.0f}")
        first_done, first_time = self._first
        elapsed = now - first_time
        if done <= first_done or elapsed <= 0:  # nothing trained since the first report
            return line
        rate = (done - first_done) / elapsed
        eta = tqdm.format_interval((self.total - done) / rate)
        return f"{line} | {tqdm.format_interval(elapsed)} elapsed, {rate:.2f} steps/s, ETA {eta}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _stop_unless_finished(client: RouterClient, run_id: str) -> None:
    try:
        client.stop_run(run_id)
    except grpc.RpcError as error:  # FAILED_PRECONDITION: it has finished in the meantime
        if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise

