"""Running real jobs against an in-process router while things go wrong: what the resilience
tests share."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

from dyad import config as config_lib
from dyad.app.client import RouterClient
from dyad.router.auth import Credentials
from dyad.router.server import serve
from dyad.wire import pb

CREDENTIALS = Credentials(client_token="test-client-token", join_token="test-join-token")

# Eight steps, a committed checkpoint every two; workers heartbeat often so a lost one is seen
# quickly.
BASE = [
    "train.steps=8", "train.warmup_steps=2", "train.global_batch=8", "train.microbatches=2",
    "checkpoint.interval_steps=2", "router.heartbeat_interval_s=0.5",
    "router.worker_timeout_s=20", "router.stop_grace_s=5", "router.step_timeout_s=120",
]


def job_config(out_dir: Path, *overrides: str) -> config_lib.RunConfig:
    config = config_lib.load(None, [*BASE, *overrides])
    return dataclasses.replace(config, out_dir=str(out_dir))


@contextlib.contextmanager
def in_process_router(**options) -> Iterator[tuple[RouterClient, object]]:
    server, state = serve(credentials=CREDENTIALS, **options)
    client = RouterClient(state.address, token=CREDENTIALS.client_token)
    try:
        yield client, state
    finally:
        for run_id in state.active_run_ids():
            state.get(run_id).stop_requested.set()
        state.wait_idle(60)
        client.close()
        server.stop(grace=None)


@dataclasses.dataclass
class Followed:
    info: pb.RunInfo
    steps: dict[int, pb.StepMetrics]  # the last metrics of each step: the run's final lineage
    notices: list[pb.RunNotice]


def follow(
    client: RouterClient, run_id: str, on_step: Callable[[pb.StepMetrics], None] = lambda m: None,
    from_step: int = 0,
) -> Followed:
    steps, notices = {}, []
    info = None
    for event in client.watch(run_id, from_step):
        kind = event.WhichOneof("event")
        if kind == "step":
            steps[event.step.step] = event.step
            on_step(event.step)
        elif kind == "notice":
            notices.append(event.notice)
        else:
            info = event.finished
    return Followed(info or client.get_run(run_id), steps, notices)


def run_followed(client: RouterClient, config, on_step=lambda m: None) -> Followed:
    info = client.start_run(config_lib.to_yaml(config))
    return follow(client, info.run_id, on_step)


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def trained_samples(out_dir: str | Path) -> dict[int, list[int]]:
    """The samples of each step of the final lineage (the last record of each step)."""
    steps = {}
    for line in (Path(out_dir) / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["samples"]
    return steps


def assert_losses_match(actual: dict, expected: dict, rtol: float = 1e-5) -> None:
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    for step, metrics in expected.items():
        got = actual[step].loss
        assert abs(got - metrics.loss) <= rtol * abs(metrics.loss), (
            f"step {step}: loss {got} vs uninterrupted {metrics.loss}"
        )
