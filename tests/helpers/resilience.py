"""Running real jobs against an in-process router while things go wrong: what the resilience
tests share."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dyad import config as config_lib
from dyad.app.client import RouterClient
from dyad.app.jobs import JobResult, run_job
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


def run_in_process(config: config_lib.RunConfig) -> JobResult:
    """`run_job(config)` on an in-process router instead of a local router process: its workers
    fork from this process's fork server, which imported torch once for the whole session, where
    each local router starts a fork server of its own (seconds of CPU a run on a 2-core machine).
    `dyad train` and `dyad verify` run on a local router process in tests/integration/test_train_cli.py."""
    with in_process_router() as (client, _):
        return run_job(config, router=client, progress=False)


@dataclasses.dataclass
class Followed:
    info: pb.RunInfo
    steps: dict[int, pb.StepMetrics]  # the last metrics of each step: the run's final lineage
    notices: list[pb.RunNotice]
    evaluations: dict[int, pb.EvalMetrics]  # the last evaluation at each step


def follow(
    client: RouterClient, run_id: str, on_step: Callable[[pb.StepMetrics], None] = lambda m: None,
    from_step: int = 0, on_notice: Callable[[pb.RunNotice], None] = lambda n: None,
) -> Followed:
    steps, notices, evaluations = {}, [], {}
    info = None
    for event in client.watch(run_id, from_step):
        kind = event.WhichOneof("event")
        if kind == "step":
            steps[event.step.step] = event.step
            on_step(event.step)
        elif kind == "notice":
            notices.append(event.notice)
            on_notice(event.notice)
        elif kind == "evaluation":
            evaluations[event.evaluation.step] = event.evaluation
        else:
            info = event.finished
    return Followed(info or client.get_run(run_id), steps, notices, evaluations)


def run_followed(client: RouterClient, config, on_step=lambda m: None, on_notice=lambda n: None) -> Followed:
    info = client.start_run(config_lib.to_yaml(config))
    return follow(client, info.run_id, on_step, on_notice=on_notice)


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def exited(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie counts: its parent has yet to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def largest_shard(checkpoint: Path, pool: str) -> Path:
    """The pool's largest DCP data file in a checkpoint directory: tensors, not metadata."""
    return max((checkpoint / pool).glob("*.distcp"), key=lambda path: path.stat().st_size)


def truncate_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip_bytes(path: Path, count: int = 64) -> None:
    """Inverts `count` bytes in the middle of the file: its size stays, its contents do not."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        data = f.read(count)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


class HeldWrite:
    """Holds a pool's rank 0 inside its write of a checkpoint: the pool's metadata file, which
    DCP writes last (`.metadata.tmp`, then renamed; its data files need a seekable stream), is
    made a FIFO whose reader reads nothing, with a one-page buffer, so the write blocks after
    its first page and the save cannot end. `wait` returns once bytes are waiting in the pipe
    (the write has begun); `release` removes the FIFO, so a later save of the same checkpoint
    writes an ordinary file."""

    def __init__(self, checkpoint: Path, pool: str):
        self.path = path = checkpoint / pool / ".metadata.tmp"
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a writer's open then does not block
        fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, os.sysconf("SC_PAGE_SIZE"))

    def wait(self, timeout_s: float = 180.0) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not any(mask & select.POLLIN for _, mask in poller.poll(1000)):  # no writer yet: no event
            assert time.monotonic() < deadline, f"nothing began writing {self.path} within {timeout_s}s"

    def release(self) -> None:
        self.path.unlink()
        os.close(self._fd)


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


def records_of(run, out_dir: Path):
    """`run`'s metrics.jsonl in `out_dir`, subscribed to it as a driver's own run does (for tests
    that drive a RunDriver's parts without `_drive`)."""
    from dyad.router.sinks import RunRecords

    records = RunRecords(Path(out_dir) / "metrics.jsonl")
    run.subscribe(records)
    return records


def start_router(tmp_path: Path, port: int, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m dyad.router` on `port` with its state in tmp_path/router.db and its log in
    tmp_path/<name>.log (`env`: its environment, default ours), once it serves."""
    port_file = tmp_path / f"{name}.address"
    env = (os.environ if env is None else env) | {
        "DYAD_TOKEN": CREDENTIALS.client_token, "DYAD_JOIN_TOKEN": CREDENTIALS.join_token,
    }
    with open(tmp_path / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dyad.router", "--port", str(port), "--port-file", str(port_file),
             "--state-db", str(tmp_path / "router.db")],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
        assert time.monotonic() < deadline, "router did not start"
        time.sleep(0.1)
    return proc
