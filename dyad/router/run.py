"""A run as the router sees it: its state, its generation of workers and their channels, its
pending requests and its event history (persisted through the router's store).

A *generation* is one membership of the pools: pool sizes, each pool's torch.distributed
rendezvous, the workers registered for it. It is bumped whenever the pools re-form (recovery
from a lost worker, a resize, a router restart); results of older generations are ignored.

Thread-safe: gRPC handler threads (register, heartbeat, command streams, results, watchers) and
the run's driver thread meet here.
"""

from __future__ import annotations

import hmac
import logging
import queue
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from dyad import config as config_lib
from dyad.config import RunConfig, to_yaml
from dyad.pools import pool_on_wire, pool_types
from dyad.router.errors import FailedPrecondition, PermissionDenied
from dyad.router.results import check_result
from dyad.router.store import NullStore, RunRecord, SentCommand
from dyad.wire import pb

log = logging.getLogger(__name__)

TERMINAL = (pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_FAILED, pb.RUN_STATE_STOPPED)
_STREAM_POLL_S = 0.5
# The last commands sent, kept (and persisted) for a router that takes the run over: a command
# can have reached only some workers when the router died, and one that did may be waiting for a
# peer that did not. The driver waits for every worker's results before it sends more than a few
# commands ahead (an update and the next step; one setup per pool), so this many always reach
# back past the last command every worker received.
_RECENT_COMMANDS = 8


def worker_key(worker: pb.WorkerId) -> tuple[str, int]:
    return pool_on_wire(worker.pool).name, worker.rank


def pool_sizes(config: RunConfig) -> dict[str, int]:
    return {pool.name: getattr(config.parallel, pool.name).world_size for pool in pool_types()}


def check_worker_count(sizes: dict[str, int], max_workers: int) -> None:
    """ValueError naming the pools' sizes if they need more processes than the launcher runs."""
    total = sum(sizes.values())
    if total > max_workers:
        needed = " + ".join(f"{size} {pool}" for pool, size in sizes.items())
        raise ValueError(
            f"the run needs {needed} = {total} worker processes (parallel.<pool> layouts), more than "
            f"this router's launcher runs ({max_workers}: dyad router --max-workers)"
        )


def _known_pools() -> str:
    return ", ".join(f"{pool.wire_id} ({pool.name})" for pool in pool_types())


@dataclass
class WorkerChannel:
    address: str
    pid: int = 0
    # The identity of the process holding the rank: issued when it registers, required on its
    # every later call, so that nobody else (a join-token holder included) speaks for it.
    key: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    commands: queue.Queue = field(default_factory=queue.Queue)
    last_seen: float = field(default_factory=time.monotonic)
    received: int = 0  # the seq of the last command it had received when it registered


class RunObserver:
    """Told what a run does (router.metrics exports it); this one ignores it all."""

    def step(self, run: Run, metrics: pb.StepMetrics) -> None: ...
    def evaluation(self, run: Run, metrics: pb.EvalMetrics) -> None: ...
    def notice(self, run: Run, notice: pb.RunNotice) -> None: ...
    def state(self, run: Run, state: int) -> None: ...
    def resize(self, run: Run) -> None: ...


class Run:
    def __init__(
        self, run_id: str, config: RunConfig, store: NullStore | None = None,
        observer: RunObserver | None = None, max_workers: int | None = None,
    ):
        self.run_id = run_id
        self.max_workers = max_workers  # the launcher's bound on the pools' processes (None: none)
        self.config = config
        self.config_yaml = to_yaml(config)  # what workers and the store get; kept with `config`
        self.store = store or NullStore()
        # Told what the run does, in order: the router's (e.g. Prometheus, dyad/router/metrics.py)
        # and the run's own sinks (dyad/router/sinks.py), which its driver subscribes.
        self._observers: list[RunObserver] = [observer] if observer else []
        self.secret = secrets.token_bytes(32)
        self.rendezvous: dict[str, str] = {}
        self.formed_at: dict[str, int] = {}  # pool -> the generation its processes joined
        # pool -> how long the processes it replaced at its last re-forming may take to end (0:
        # router.stop_grace_s)
        self.exit_within_s: dict[str, float] = {}
        self.restores = False  # the current generation's setup restores a checkpoint
        self.commands_sent = 0  # WorkerCommand.seq of the last command sent
        self.recent_commands: list[SentCommand] = []
        self.pids: dict[str, int] = {}
        self.results: queue.Queue[pb.WorkerResult] = queue.Queue()
        # Each worker's last reported failure: why a worker that then exits did (see failure_of).
        self._failures: dict[tuple[str, int], pb.WorkerResult] = {}
        self.stop_requested = threading.Event()
        self.checkpoint_requested = threading.Event()
        self._scale_requests: dict[str, int] = {}
        self._lock = threading.Condition()
        self._workers: dict[tuple[str, int], WorkerChannel] = {}
        self._events: list[pb.RunEvent] = []
        self._info = pb.RunInfo(
            run_id=run_id,
            state=pb.RUN_STATE_STARTING,
            total_steps=config.train.steps,
            out_dir=config.out_dir,
        )
        self._set_sizes()

    @classmethod
    def restored(
        cls, record: RunRecord, store: NullStore, observer: RunObserver | None = None,
        max_workers: int | None = None,
    ) -> Run:
        """A run read back from the store by a restarted router."""
        run = cls(record.run_id, config_lib.from_yaml(record.config_yaml), store, observer, max_workers)
        run._info = pb.RunInfo.FromString(record.info)
        run.secret = bytes.fromhex(record.secret)
        run.rendezvous = dict(record.rendezvous)
        run.formed_at = dict(record.formed_at)
        run.pids = dict(record.pids)
        run.exit_within_s = dict(record.exit_within_s)
        run.restores = record.restores
        run.recent_commands = store.commands(record.run_id)
        run.commands_sent = run.recent_commands[-1][0] if run.recent_commands else 0
        run._events = store.events(record.run_id)
        return run

    @property
    def pool_sizes(self) -> dict[str, int]:
        return pool_sizes(self.config)

    @property
    def generation(self) -> int:
        with self._lock:
            return self._info.generation

    def _set_sizes(self) -> None:
        sizes = self.pool_sizes
        self._info.encoder_replicas, self._info.llm_replicas = sizes["encoder"], sizes["llm"]

    def subscribe(self, observer: RunObserver) -> None:
        self._observers.append(observer)

    def unsubscribe(self, observer: RunObserver) -> None:
        self._observers.remove(observer)

    def _tell(self, event: str, *args) -> None:
        """Every observer's `event`, in the thread that made it happen: a sink that cannot record
        it (a full disk) raises to the driver, which ends the run."""
        for observer in list(self._observers):
            getattr(observer, event)(self, *args)

    def persist(self) -> None:
        with self._lock:
            record = RunRecord(
                run_id=self.run_id,
                config_yaml=self.config_yaml,
                info=self._info.SerializeToString(),
                secret=self.secret.hex(),
                rendezvous=dict(self.rendezvous),
                formed_at=dict(self.formed_at),
                pids=dict(self.pids),
                exit_within_s=dict(self.exit_within_s),
                restores=self.restores,
            )
        self.store.save_run(record)

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
                self._append(finished)
            self._lock.notify_all()
        self.persist()
        self._tell("state", state)

    def _append(self, event: pb.RunEvent) -> None:
        self._events.append(event)
        self.store.append_event(self.run_id, len(self._events) - 1, event)

    def record_step(self, metrics: pb.StepMetrics) -> None:
        with self._lock:
            self._info.step = metrics.step + 1
            self._append(pb.RunEvent(step=metrics))
            self._lock.notify_all()
        self.persist()
        self._tell("step", metrics)

    def record_evaluation(self, metrics: pb.EvalMetrics) -> None:
        with self._lock:
            self._append(pb.RunEvent(evaluation=metrics))
            self._lock.notify_all()
        self.persist()
        self._tell("evaluation", metrics)

    def notice(self, kind: str, step: int, message: str) -> pb.RunNotice:
        with self._lock:
            notice = pb.RunNotice(
                step=step, kind=kind, message=message,
                generation=self._info.generation, recoveries=self._info.recoveries,
            )
            self._append(pb.RunEvent(notice=notice))
            self._lock.notify_all()
        self.persist()
        self._tell("notice", notice)
        return notice

    def continue_from(self, step: int) -> None:
        """The run goes on from `step` steps done: a start, or a rewind to a checkpoint."""
        with self._lock:
            self._info.step = step
        self.persist()

    def count_recovery(self) -> int:
        with self._lock:
            self._info.recoveries += 1
            return self._info.recoveries

    def set_checkpoint(self, path: str) -> None:
        with self._lock:
            self._info.last_checkpoint = path
        self.persist()

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
            kind = event.WhichOneof("event")
            if kind in ("step", "notice", "evaluation") and getattr(event, kind).step < from_step:
                continue
            yield event
            if kind == "finished":
                return

    def count_skipped(self) -> int:
        """One more step whose update was skipped (a non-finite loss or gradient norm); the
        run's count of them."""
        with self._lock:
            self._info.skipped_steps += 1
            count = self._info.skipped_steps
        self.persist()
        return count

    # ------------------------------------------------------------------ requests between steps

    def request_scale(self, pool: int, replicas: int) -> None:
        if pool_on_wire(pool) is None:
            raise ValueError(f"pool must be one of {_known_pools()}, got {pool}")
        name = pool_on_wire(pool).name
        with self._lock:
            if self._info.state in TERMINAL:
                raise FailedPrecondition(f"run {self.run_id} has already finished")
            if self.max_workers is not None:
                check_worker_count(self.pool_sizes | self._scale_requests | {name: replicas}, self.max_workers)
            config_lib.scaled(self.config, name, replicas)  # refuse now what cannot run
            self._scale_requests[name] = replicas

    def has_scale_requests(self) -> bool:
        with self._lock:
            return bool(self._scale_requests)

    def take_scale_requests(self) -> dict[str, int]:
        with self._lock:
            requests, self._scale_requests = self._scale_requests, {}
            return requests

    def resize(self, config: RunConfig) -> None:
        with self._lock:
            self.config = config
            self.config_yaml = to_yaml(config)
            self._set_sizes()
        self._tell("resize")

    # ------------------------------------------------------------------ generations and workers

    def new_generation(
        self, restarting: Iterable[str], rendezvous: dict[str, str], restores: bool = False,
        exit_within_s: float = 0.0,
    ) -> int:
        """Start the next generation: workers of `restarting` pools must register again (at
        the pools' current sizes); every worker's pending commands are dropped. `restores`: its
        setup will restore a committed checkpoint into the restarted pools (their workers are
        told so when they register, and skip drawing initial weights). `exit_within_s`: how long
        the processes replaced may take to end, told to them by `heartbeat` (0:
        router.stop_grace_s)."""
        restarting = set(restarting)
        with self._lock:
            self._info.generation += 1
            self.restores = restores
            self.rendezvous.update(rendezvous)
            for pool in restarting:
                self.formed_at[pool] = self._info.generation
                self.exit_within_s[pool] = exit_within_s
            for key in list(self._workers):
                if key[0] in restarting or key[1] >= self.pool_sizes[key[0]]:
                    del self._workers[key]
            for channel in self._workers.values():
                channel.commands = queue.Queue()
            self.pids = {f"{p}/{r}": c.pid for (p, r), c in self._workers.items()}
            generation = self._info.generation
            self._lock.notify_all()
        self.persist()
        return generation

    def _check_worker(self, worker: pb.WorkerId) -> tuple[str, int]:
        if pool_on_wire(worker.pool) is None:
            raise ValueError(f"worker.pool must be one of {_known_pools()}, got {worker.pool}")
        pool, rank = worker_key(worker)
        size = self.pool_sizes[pool]
        if rank < 0:
            raise ValueError(f"worker.rank must be >= 0, got {rank}")
        if rank >= size:  # valid once, maybe: the pool may have shrunk
            raise FailedPrecondition(
                f"worker.rank ({rank}) is not in the {pool} pool, which has {size} ranks now"
            )
        return pool, rank

    def register(
        self, worker: pb.WorkerId, data_address: str, pid: int, generation: int = 0,
        worker_key: bytes = b"", last_command: int = 0,
    ) -> pb.RegisterReply:
        """A new process (generation 0), or one of the pool's current processes registering
        again (after a router restart, or a broken command stream: it shows the `worker_key` it
        was issued). A process of a pool that has re-formed since it joined is refused: it must
        exit, and its replacement registers. So is a second process for a rank whose holder is
        alive (heard from within three heartbeat intervals): a stray or hostile registration
        never takes a working rank's channel."""
        key = self._check_worker(worker)
        if not data_address:
            raise ValueError("data_address must be set (the worker's UCX listener host:port)")
        if generation < 0:
            raise ValueError(f"generation must be >= 0, got {generation}")
        if self.finished:
            raise FailedPrecondition(f"run {self.run_id} has already finished")
        with self._lock:
            if key[0] not in self.rendezvous:
                raise FailedPrecondition(f"the {key[0]} pool of run {self.run_id} is not starting yet")
            if 0 < generation < self.formed_at.get(key[0], 0):
                raise FailedPrecondition(
                    f"the {key[0]} pool re-formed at generation {self.formed_at[key[0]]}; a process "
                    f"of generation {generation} must exit and be replaced"
                )
            held = self._workers.get(key)
            if held is not None and not hmac.compare_digest(held.key, worker_key):
                self._refuse_duplicate(key, held, data_address, pid)
            channel = WorkerChannel(address=data_address, pid=pid, received=last_command)
            if held is not None and held.key == worker_key:
                channel.key = held.key
            self._workers[key] = channel
            self.pids[f"{key[0]}/{key[1]}"] = pid
            reply = pb.RegisterReply(
                config_yaml=self.config_yaml,
                out_dir=self.config.out_dir,
                generation=self._info.generation,
                dist_address=self.rendezvous[key[0]],
                run_secret=self.secret,
                run_id=self.run_id,
                restores=self.restores,
                worker_key=channel.key,
            )
            self._lock.notify_all()
        self.persist()
        return reply

    def _refuse_duplicate(self, key: tuple[str, int], held: WorkerChannel, address: str, pid: int) -> None:
        """Called with the lock held: a registration for a rank another process holds."""
        silent_s = time.monotonic() - held.last_seen
        if silent_s > 3 * self.config.router.heartbeat_interval_s:
            return  # its holder is gone (a restarted pod's process replaces it)
        log.warning(
            "run %s: refused a second registration of %s/%d (from %s, pid %d): the rank is held by "
            "pid %d at %s, heard from %.1fs ago", self.run_id, *key, address, pid, held.pid,
            held.address, silent_s,
        )
        raise FailedPrecondition(
            f"worker {key[0]}/{key[1]} is held by a live process (pid {held.pid}); a second "
            "registration is refused"
        )

    def channel(self, worker: pb.WorkerId, worker_key: bytes) -> WorkerChannel:
        """The channel of the process that registered as `worker` and was issued `worker_key`."""
        key = self._check_worker(worker)
        with self._lock:
            if key not in self._workers:
                raise FailedPrecondition(f"worker {key[0]}/{key[1]} has not registered")
            channel = self._workers[key]
        if not hmac.compare_digest(channel.key, worker_key):
            log.warning("run %s: refused a call for %s/%d with a worker_key it was not issued", self.run_id, *key)
            raise PermissionDenied(
                f"worker_key is not the one issued to {key[0]}/{key[1]} when it registered"
            )
        return channel

    def registered(self, pools: Iterable[str] | None = None) -> dict[tuple[str, int], WorkerChannel]:
        with self._lock:
            return {k: c for k, c in self._workers.items() if pools is None or k[0] in pools}

    def missing(self) -> list[tuple[str, int]]:
        with self._lock:
            return [
                (pool, rank)
                for pool, size in self.pool_sizes.items()
                for rank in range(size)
                if (pool, rank) not in self._workers
            ]

    def wait_for_workers(self, timeout_s: float, check) -> bool:
        """Wait until every rank of both pools has registered; `check()` may raise to abort."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.missing():
                if time.monotonic() > deadline:
                    return False
                self._lock.release()
                try:
                    check()
                finally:
                    self._lock.acquire()
                self._lock.wait(0.2)
        return True

    def heartbeat(self, worker: pb.WorkerId, worker_key: bytes, generation: int = 0) -> tuple[bool, float]:
        """(stop, exit_within_s) for one beat of `worker`, a process of `generation` (0: not
        said). A process of a pool that has re-formed since is told to stop, within what the
        re-forming allowed, and leaves its replacement's channel alone."""
        key = self._check_worker(worker)
        with self._lock:
            if 0 < generation < self.formed_at.get(key[0], 0):
                return True, self.exit_within_s.get(key[0], 0.0)
            if generation > 0 and key not in self._workers:
                # A process of the pool as it is that has not registered with this router yet:
                # busy finishing a command the router it had sent before it died. It goes on.
                return self.finished or self.stop_requested.is_set(), 0.0
        self.channel(worker, worker_key).last_seen = time.monotonic()
        return self.finished or self.stop_requested.is_set(), 0.0

    def send(self, command: pb.WorkerCommand, pools: Iterable[str] | None = None) -> None:
        """Number `command`, keep it among the recent ones (persisted before any worker can have
        it), and queue it for the registered workers of `pools` (all: None)."""
        pools = tuple(pools) if pools is not None else None
        with self._lock:
            self.commands_sent += 1
            command.seq = self.commands_sent
            sent = (command.seq, pools, command)
            self.recent_commands = [*self.recent_commands, sent][-_RECENT_COMMANDS:]
        self.store.keep_command(self.run_id, sent, _RECENT_COMMANDS)
        for channel in self.registered(pools).values():
            channel.commands.put(command)

    def missed_by(self, key: tuple[str, int]) -> list[pb.WorkerCommand]:
        """The recent commands for `key`'s pool that its process had not received when it
        registered: those a router that died sent to only some workers."""
        with self._lock:
            received = self._workers[key].received
            return [
                command for seq, pools, command in self.recent_commands
                if seq > received and (pools is None or key[0] in pools)
            ]

    def commands_for(self, worker: pb.WorkerId, worker_key: bytes, is_active) -> Iterator[pb.WorkerCommand]:
        channel = self.channel(worker, worker_key)
        while is_active():
            try:
                command = channel.commands.get(timeout=_STREAM_POLL_S)
            except queue.Empty:
                continue
            yield command
            if command.HasField("stop"):
                return

    def report(self, result: pb.WorkerResult) -> None:
        channel = self.channel(result.worker, result.worker_key)
        check_result(result, self.config.train.steps)
        channel.last_seen = time.monotonic()
        if result.WhichOneof("result") == "error":
            with self._lock:
                self._failures[worker_key(result.worker)] = result
        self.results.put(result)

    def failure_of(self, key: tuple[str, int]) -> pb.WorkerResult | None:
        """The failure `key` reported in the current generation, if it reported one."""
        with self._lock:
            failure = self._failures.get(key)
        return failure if failure is not None and failure.generation == self.generation else None
