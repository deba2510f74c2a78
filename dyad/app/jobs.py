"""Running a job end to end from the client's side: start a local router (or use a given one),
submit the config, follow the run's metrics with a progress bar, and report the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from tqdm import tqdm

from dyad import config as config_lib
from dyad.app.client import RouterClient, local_router
from dyad.config import RunConfig
from dyad.router.checkpoints import checkpoint_dir
from dyad.router.records import JsonLines, json_line
from dyad.wire import as_dict, pb


@dataclass
class JobResult:
    info: pb.RunInfo
    metrics: list[dict]

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
    checkpoint (benchmarks measure steps, and a checkpoint gathers every tensor at full size)."""
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(config_lib.to_yaml(config))
    if router is not None:
        return _follow(router, config, progress, stop_after)
    with local_router(out_dir / "logs" / "router.log") as client:
        return _follow(client, config, progress, stop_after)


def _follow(
    client: RouterClient, config: RunConfig, progress: bool, stop_after: int | None
) -> JobResult:
    info = client.start_run(config_lib.to_yaml(config))
    bar = tqdm(total=info.total_steps, desc="train", unit="step", disable=not progress)
    by_step: dict[int, dict] = {}  # a recovery trains steps again: the last record counts
    try:
        for event in client.watch(info.run_id):
            kind = event.WhichOneof("event")
            if kind == "step":
                record = as_dict(event.step)
                by_step[record["step"]] = record
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if record["skipped"]:
                    bar.write(f"step {record['step']} skipped: loss {record['loss']}, grad_norm {record['grad_norm']}")
                bar.n = record["step"] + 1
                bar.refresh()
                if record["step"] == stop_after:
                    _stop_unless_finished(client, info.run_id)
            elif kind == "notice":
                notice = event.notice
                if notice.kind != "checkpoint":
                    bar.write(f"{notice.kind} at step {notice.step}: {notice.message}")
            elif kind == "finished":
                info = event.finished
    except KeyboardInterrupt:
        client.stop_run(info.run_id)
        raise
    finally:
        bar.close()
    metrics = [by_step[step] for step in sorted(by_step)]
    return JobResult(info=client.get_run(info.run_id), metrics=metrics)


def _stop_unless_finished(client: RouterClient, run_id: str) -> None:
    try:
        client.stop_run(run_id)
    except grpc.RpcError as error:  # FAILED_PRECONDITION: it has finished in the meantime
        if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise


def append_record(out_dir: Path, record: dict) -> None:
    """A record at the end of the run's metrics.jsonl, whole or not at all (OSError)."""
    with JsonLines(Path(out_dir) / "metrics.jsonl") as f:
        f.write(json_line(record))


def plot_losses(metrics: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["loss"] for m in metrics], label="loss")
    ax.plot(steps, [m["lm_loss"] for m in metrics], label="lm_loss", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
