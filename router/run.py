"""A run as the router sees it: its state, its workers' channels and its event history.

Thread-safe: gRPC handler threads (register, heartbeat, command streams, results, watchers) and
the run's driver thread meet here.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from dyad.config import RunConfig, to_yaml
from dyad.wire import pb
from dyad.router.errors import FailedPrecondition

POOLS = {pb.POOL_ENCODER: "encoder", pb.POOL_LLM: "llm"}
TERMINAL = (pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_FAILED, pb.RUN_STATE_STOPPED)
_STREAM_POLL_S = 0.5


def worker_key(worker: pb.WorkerId) -> tuple[str, int]:
    return POOLS[worker.pool], worker.rank


@dataclass
class WorkerChannel:
    address: str
    commands: queue.Queue = field(default_factory=queue.Queue)
    last_seen: float = field(default_factory=time.monotonic)


class Run:
    def __init__(self, run_id: str, config: RunConfig, pool_sizes: dict[str, int]):
        self.run_id = run_id
        self.config = config
        self.config_yaml = to_yaml(config)
        self.pool_sizes = pool_sizes
        self.results: queue.Queue[pb.WorkerResult] = queue.Queue()
        self.stop_requested = threading.Event()
        self._lock = threading.Condition()
        self._workers: dict[tuple[str, int], WorkerChannel] = {}
        self._events: list[pb.RunEvent] = []
        self._info = pb.RunInfo(
            run_id=run_id,
            state=pb.RUN_STATE_STARTING,
            total_steps=config.train.steps,
            out_dir=config.out_dir,
        )

    # ------------------------------------------------------------------ state and events

    def info(self) -> pb.RunInfo:
        with self._lock:
            copy = pb.RunInfo()
            copy.CopyFrom(self._info)
            return copy

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._info.state in TERMINAL

    def set_state(self, state: int, message: str = "") -> None:
        with self._lock:
            if self._info.state in TERMINAL:
                return
            self._info.state = state
            self._info.message = message
            if state in TERMINAL:
                finished = pb.RunEvent()
                finished.finished.CopyFrom(self._info)
                self._events.append(finished)
            self._lock.notify_all()

    def record_step(self, metrics: pb.StepMetrics) -> None:
        with self._lock:
            self._info.step = metrics.step + 1
            self._events.append(pb.RunEvent(step=metrics))
            self._lock.notify_all()

    def watch(self, from_step: int, is_active) -> Iterator[pb.RunEvent]:
        """Replay events of steps >= from_step, then follow live until the run ends."""
        index = 0
        while True:
            with self._lock:
                while index >= len(self._events):
                    if not is_active():
                        return
                    self._lock.wait(_STREAM_POLL_S)
                event = self._events[index]
            index += 1
            if event.HasField("step") and event.step.step < from_step:
                continue
            yield event
            if event.HasField("finished"):
                return

    # ------------------------------------------------------------------ workers

    def _check_worker(self, worker: pb.WorkerId) -> tuple[str, int]:
        if worker.pool not in POOLS:
            raise ValueError(f"worker.pool must be POOL_ENCODER or POOL_LLM, got {worker.pool}")
        pool, rank = worker_key(worker)
        if not 0 <= rank < self.pool_sizes[pool]:
            raise ValueError(
                f"worker.rank ({rank}) out of range for the {pool} pool of {self.pool_sizes[pool]}"
            )
        return pool, rank

    def register(self, worker: pb.WorkerId, data_address: str) -> None:
        key = self._check_worker(worker)
        if not data_address:
            raise ValueError("data_address must be set (the worker's UCX listener host:port)")
        if self.finished:
            raise FailedPrecondition(f"run {self.run_id} has already finished")
        with self._lock:
            self._workers[key] = WorkerChannel(address=data_address)
            self._lock.notify_all()

    def channel(self, worker: pb.WorkerId) -> WorkerChannel:
        key = self._check_worker(worker)
        with self._lock:
            if key not in self._workers:
                raise FailedPrecondition(f"worker {key[0]}/{key[1]} has not registered")
            return self._workers[key]

    def registered(self) -> dict[tuple[str, int], WorkerChannel]:
        with self._lock:
            return dict(self._workers)

    def wait_for_workers(self, timeout_s: float, should_abort) -> bool:
        expected = sum(self.pool_sizes.values())
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self._workers) < expected:
                if time.monotonic() > deadline or should_abort():
                    return False
                self._lock.wait(0.2)
        return True

    def heartbeat(self, worker: pb.WorkerId) -> bool:
        self.channel(worker).last_seen = time.monotonic()
        return self.finished or self.stop_requested.is_set()

    def send(self, command: pb.WorkerCommand) -> None:
        for channel in self.registered().values():
            channel.commands.put(command)

    def commands_for(self, worker: pb.WorkerId, is_active) -> Iterator[pb.WorkerCommand]:
        channel = self.channel(worker)
        while is_active():
            try:
                command = channel.commands.get(timeout=_STREAM_POLL_S)
            except queue.Empty:
                continue
            yield command
            if command.HasField("stop"):
                return

    def report(self, result: pb.WorkerResult) -> None:
        self.channel(result.worker).last_seen = time.monotonic()
        if result.WhichOneof("result") is None:
            raise ValueError("result must be one of step, apply, save or error")
        self.results.put(result)
