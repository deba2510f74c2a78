"""The router's gRPC server: the client-facing `Router` service, the worker-facing `Coordinator`
service, and grpc.health.v1.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dyad import config as config_lib
from dyad.data import make_dataset
from dyad.router.auth import Credentials, TokenInterceptor
from dyad.router.checkpoints import resume_candidates
from dyad.router.driver import RunDriver
from dyad.router.errors import FailedPrecondition, NotFound, map_errors
from dyad.router.launcher import Launcher, LocalLauncher
from dyad.router.run import Run, check_worker_count, pool_sizes
from dyad.router.sinks import check_sinks
from dyad.router.store import open_store
from dyad.router.streams import MAX_WATCHERS, THREADS_BESIDES_WATCHERS, StreamSlots
from dyad.wire import GRPC_OPTIONS, pb, rpc

log = logging.getLogger(__name__)

class RouterState:
    """Runs known to this router (at most one active at a time), persisted in `state_db` when
    given so that a restarted router resumes them."""

    def __init__(
        self, launcher_factory: Callable[[], Launcher] = LocalLauncher, state_db: str | None = None,
        observer=None, max_watchers: int = MAX_WATCHERS,
    ):
        self.address = ""
        self.watchers = StreamSlots(max_watchers, "dyad router --max-watchers")
        self.credentials = None  # set by `serve`; its join token goes to launched workers
        self._launcher_factory = launcher_factory
        self._observer = observer  # e.g. the Prometheus metrics (dyad/router/metrics.py)
        self._store = open_store(state_db)
        self._runs: dict[str, Run] = {}
        self._drivers: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def get(self, run_id: str) -> Run:
        if not run_id:
            raise ValueError("run_id must be set")
        with self._lock:
            if run_id not in self._runs:
                raise NotFound(f"run_id {run_id!r} not found")
            return self._runs[run_id]

    def start(self, config_yaml: str, still_wanted: Callable[[], bool] = lambda: True) -> Run:
        """Validate the config and start its run. `still_wanted()` is asked once validation (the
        dataset's records included, which can take long) is done: a caller that gave up by then
        (its deadline passed) gets no run."""
        config = config_lib.from_yaml(config_yaml)
        check_sinks(config.metrics)
        launcher = self._launcher_factory()
        check_worker_count(pool_sizes(config), launcher.max_workers)  # before reading any data
        dataset = make_dataset(config.data)
        config = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
        if config.checkpoint.resume_from:
            # Refuse a path that holds no checkpoint now; the driver verifies the files (reading
            # them all, which a caller's deadline need not wait for).
            resume_candidates(config.checkpoint.resume_from)
        if not still_wanted():
            log.warning("StartRun's caller gave up (deadline or cancel) while its config was validated: no run started")
            raise FailedPrecondition("the caller's deadline passed while the config was validated; no run was started")
        run_id = uuid.uuid4().hex[:12]
        if not config.out_dir:
            config.out_dir = str(Path("runs") / run_id)
        config.out_dir = str(Path(config.out_dir).resolve())
        with self._lock:
            active = [r for r in self._runs.values() if not r.finished]
            if active:
                raise FailedPrecondition(
                    f"run {active[0].run_id} is still active; stop it before starting another"
                )
            run = Run(run_id, config, self._store, self._observer, launcher.max_workers)
            self._runs[run_id] = run
        run.persist()
        self._drive(run, launcher, dataset, resumed=False)
        return run

    def load_runs(self) -> list[tuple[Run, Launcher]]:
        """The runs of the store, known from now on (before the server answers its first call:
        a worker re-registering must find its run); those that had not finished, with their
        launchers, for `resume_runs`."""
        unfinished = []
        for record in self._store.runs():
            launcher = self._launcher_factory()
            run = Run.restored(record, self._store, self._observer, launcher.max_workers)
            with self._lock:
                self._runs[run.run_id] = run
            if not run.finished:
                unfinished.append((run, launcher))
        return unfinished

    def resume_runs(self, unfinished: list[tuple[Run, Launcher]]) -> None:
        """Drive again the runs `load_runs` found unfinished (once `address` is set)."""
        for run, launcher in unfinished:
            log.info("resuming run %s from the state store", run.run_id)
            self._drive(run, launcher, make_dataset(run.config.data), resumed=True)

    def _drive(self, run: Run, launcher: Launcher, dataset, *, resumed: bool) -> None:
        worker_env = {"DYAD_JOIN_TOKEN": self.credentials.join_token} if self.credentials else {}
        driver = RunDriver(
            run, launcher, self.address, dataset,
            worker_env=worker_env, resumed=resumed,
        )
        thread = threading.Thread(target=driver, name=f"run-{run.run_id}", daemon=True)
        self._drivers[run.run_id] = thread
        thread.start()

    def active(self) -> Run:
        """The run pool workers join when they do not name one (Kubernetes pods)."""
        with self._lock:
            active = [run for run in self._runs.values() if not run.finished]
        if not active:
            raise FailedPrecondition("no active run to join")
        return active[0]

    def active_run_ids(self) -> list[str]:
        with self._lock:
            return [run_id for run_id, run in self._runs.items() if not run.finished]

    def wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in list(self._drivers.values()):
            thread.join(max(0.0, deadline - time.monotonic()))


@map_errors
class RouterService(rpc.RouterServicer):
    def __init__(self, state: RouterState):
        self.state = state

    def StartRun(self, request, context):
        return self.state.start(request.config_yaml, context.is_active).info()

    def GetRun(self, request, context):
        return self.state.get(request.run_id).info()

    def GetActiveRun(self, request, context):
        run_ids = self.state.active_run_ids()
        return self.state.get(run_ids[0]).info() if run_ids else pb.RunInfo()

    def WatchRun(self, request, context):
        if request.from_step < 0:
            raise ValueError(f"from_step must be >= 0, got {request.from_step}")
        run = self.state.get(request.run_id)
        with self.state.watchers.slot():
            yield from run.watch(request.from_step, context.is_active)

    def StopRun(self, request, context):
        run = self._active(request.run_id)
        run.stop_requested.set()
        return run.info()

    def ScalePool(self, request, context):
        run = self._active(request.run_id)
        run.request_scale(request.pool, request.replicas)
        return run.info()

    def Checkpoint(self, request, context):
        run = self._active(request.run_id)
        run.checkpoint_requested.set()
        return run.info()

    def _active(self, run_id: str) -> Run:
        run = self.state.get(run_id)
        if run.finished:
            raise FailedPrecondition(f"run {run.run_id} has already finished")
        if run.stop_requested.is_set():
            raise FailedPrecondition(f"run {run.run_id} is stopping")
        return run


@map_errors
class CoordinatorService(rpc.CoordinatorServicer):
    def __init__(self, state: RouterState):
        self.state = state

    def Register(self, request, context):
        run = self.state.get(request.run_id) if request.run_id else self.state.active()
        return run.register(
            request.worker, request.data_address, request.pid, request.generation,
            request.worker_key, request.last_command,
        )

    def Heartbeat(self, request, context):
        run = self.state.get(request.run_id)
        stop, exit_within_s = run.heartbeat(request.worker, request.worker_key, request.generation)
        return pb.HeartbeatReply(stop=stop, exit_within_s=exit_within_s)

    def Commands(self, request, context):
        run = self.state.get(request.run_id)
        yield from run.commands_for(request.worker, request.worker_key, context.is_active)

    def ReportResult(self, request, context):
        self.state.get(request.run_id).report(request)
        return pb.Ack()


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    launcher_factory=LocalLauncher,
    *,
    credentials: Credentials,
    tls: grpc.ServerCredentials | None = None,
    **state_options,
):
    """Start the router; returns (server, state) with `state.address` set to "host:port".

    `Router` calls need `credentials.client_token`, `Coordinator` calls its join token; with
    `tls` the port is TLS only. `state_options` go to `RouterState`.
    """
    state = RouterState(launcher_factory, **state_options)
    state.credentials = credentials  # the launcher hands the join token to its workers
    unfinished = state.load_runs()
    threads = state.watchers.limit + THREADS_BESIDES_WATCHERS
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
        options=GRPC_OPTIONS,
        interceptors=[TokenInterceptor(credentials)],
    )
    rpc.add_RouterServicer_to_server(RouterService(state), server)
    rpc.add_CoordinatorServicer_to_server(CoordinatorService(state), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"router could not bind {host}:{port}")
    server.start()
    state.address = f"{host}:{bound}"
    for service in ("", "dyad.v1.Router", "dyad.v1.Coordinator"):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    state.resume_runs(unfinished)
    return server, state
