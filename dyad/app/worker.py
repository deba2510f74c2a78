"""A worker process: registers with the router, heartbeats, and executes the router's commands
with its pool type's service (`dyad.pools`: the class it names, imported only in this process).

    python -m dyad.app.worker --router HOST:PORT [--run-id ID] --pool encoder --rank 0

The join token comes from `$DYAD_JOIN_TOKEN` or `--join-token-file`. Without `--run-id` the
worker joins the router's active run, waiting for one (Kubernetes pods, see `dyad.app.pod`). The
router's reply to Register names the run, the generation to join, the pool's torch.distributed
rendezvous and the run's config (its layouts at the pools' current sizes). The UCX listener is
announced at `$POD_IP` when set (a pod's routable address), else 127.0.0.1.

A process serves one generation of its pool's process groups. Told to stop (the run ended, or
its pool re-forms), it exits; its supervisor (the local launcher, or the StatefulSet on
Kubernetes) starts a fresh one. When the router goes away, it registers again (for up to
`router.reconnect_timeout_s`) and carries on in place if the router keeps its pool as it is.

A process that cannot obey a stop, its main thread stuck (in a collective whose peers are gone,
or waiting for a rendezvous that never comes), exits by itself: its heartbeat thread sees that
the router has released it (a heartbeat answered `stop`, or refused because the process is no
longer one of its pool's), and `router.stop_grace_s` later ends the process with
STUCK_EXIT_CODE; sooner where the router's answer says so: a process whose pool re-formed to
recover from a failure gets `router.abort_grace_s`, since its replacement (in a pod, the same
container) waits for it. In a pod (`$DYAD_PULSE_FD` set, dyad/app/pod.py) the heartbeat thread also
writes a byte to that pipe on every beat: the pod's supervisor stops a worker whose pulses stop (a
process frozen whole, its heartbeat thread included).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import sys
import threading
import time
import traceback

import grpc
import torch
import torch.distributed as dist

from dyad import config as config_lib
from dyad.app.pod import PULSE_FD_ENV, STUCK_EXIT_CODE
from dyad.channels import open_channel
from dyad.credentials import load_token
from dyad.gc_pauses import GcPauses
from dyad.pools import pool_names, pool_type
from dyad.startup import StartupTimeline
from dyad.transport import UcxTransport
from dyad.wire import pb, rpc

log = logging.getLogger("dyad.app.worker")
_RETRY_S = 1.0
_WAIT_FOR_RUN_S = 5.0
_GC_PAUSE_LOGGED_S = 1e-3
# Heartbeat answers that say the router no longer counts on this process.
_RELEASED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)


# How running out of GPU memory reads where it is not torch's allocator that fails: NCCL's own
# allocations (a DistBackendError, e.g. in a gradient all-reduce: seen on two H100s, LLM ranks
# sharing a GPU with the encoder), a CUDA call torch checks, and cuBLAS creating its workspace.
_OUT_OF_MEMORY_MARKERS = ("Cuda failure 2 'out of memory'", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
# A full filesystem, or the user's quota on it used up.
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


def would_repeat(error: BaseException) -> bool:
    """Whether the same command would fail again after a restart from the checkpoint: running
    out of GPU memory does (same model, same batch, same layout), and so does running out of
    disk space (the restart writes the same checkpoints); a lost peer does not. Looks through
    the exceptions that caused `error`."""
    for cause in _causes(error):
        if isinstance(cause, torch.OutOfMemoryError) or getattr(cause, "errno", None) in _OUT_OF_SPACE:
            return True
        if any(marker in str(cause) for marker in _OUT_OF_MEMORY_MARKERS):
            return True
    return False


def _causes(error: BaseException):
    """`error`, the exceptions it was raised from or while handling (`__cause__`, `__context__`),
    and those torch.distributed.checkpoint's CheckpointException holds (`failures`: rank ->
    (exception, traceback)), each once."""
    seen, pending = set(), [error]
    while pending:
        cause = pending.pop()
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        yield cause
        pending += [cause.__cause__, cause.__context__]
        failures = getattr(cause, "failures", None)  # a CheckpointException's, not some other class's
        if isinstance(failures, dict):
            pending += [failure for failure, _ in failures.values()]


class RouterLost(RuntimeError):
    """The router did not answer; register again."""


class WorkerRuntime:
    def __init__(self, router: str, run_id: str, pool: str, rank: int, join_token: str):
        self.run_id = run_id
        self.worker = pb.WorkerId(pool=pool_type(pool).wire_id, rank=rank)
        self.pool, self.rank = pool, rank
        self.channel = open_channel(router, token=join_token)
        self.stub = rpc.CoordinatorStub(self.channel)
        self.generation = 0
        self.worker_key = b""  # issued by the router at each registration, shown on every call
        self.last_command = 0  # the seq of the last command received, told when registering again
        self._stopped = threading.Event()
        self._gc = GcPauses()
        self._startup = StartupTimeline()
        self._profiled = StepProfiler.from_environment(pool, rank)

    def run(self) -> None:
        with UcxTransport(host=os.environ.get("POD_IP", "127.0.0.1")) as transport:
            self._startup.done("UCX listener")
            if self.run_id:
                reply = self._register(transport.address, timeout_s=60.0)
            else:
                reply = self._wait_for_a_run(transport.address)
            self._startup.done("registration")
            self.run_id = reply.run_id
            self.generation = reply.generation  # joined; its setup may name a later one
            config = config_lib.from_yaml(reply.config_yaml)
            self.dist_address = reply.dist_address
            threading.Thread(
                target=self._heartbeat,
                args=(config.router.heartbeat_interval_s, config.router.stop_grace_s),
                daemon=True,
            ).start()
            self._join_pool(config, reply.dist_address)
            self._startup.done("process group")
            service = self._built(config, transport, initialize=not reply.restores)
            self._startup.done("model and optimizer")
            log.info("generation %d: %s%s", reply.generation, self._startup.summary(),
                     ", no initial weights drawn (a checkpoint is restored)" if reply.restores else "")
            service.run_secret = reply.run_secret
            try:
                while not self._execute(service):
                    if not self._rejoin(transport.address, config):
                        break
            finally:
                self._stopped.set()
                service.close()
                dist.destroy_process_group()

    def _built(self, config, transport, initialize: bool = True):
        """The pool's service (`initialize`: with its initial weights drawn, which a restore would
        overwrite). A failure to build it (e.g. the model does not fit on the GPU) is reported to
        the router as one of the generation joined, then raised."""
        try:
            return pool_type(self.pool).service_class()(config, transport, self.rank, self.run_id, initialize=initialize)
        except Exception as error:  # noqa: BLE001 - reported to the router, then this worker exits
            self._report_failure(error)
            raise

    def _register(self, data_address: str, timeout_s: float) -> pb.RegisterReply:
        request = pb.RegisterRequest(
            run_id=self.run_id, worker=self.worker, data_address=data_address,
            generation=self.generation, pid=os.getpid(), worker_key=self.worker_key,
            last_command=self.last_command,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                timeout = min(60.0, max(1.0, deadline - time.monotonic()))
                reply = self.stub.Register(request, wait_for_ready=True, timeout=timeout)
                self.worker_key = reply.worker_key
                return reply
            except grpc.RpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if time.monotonic() > deadline:
                    raise RouterLost(f"the router did not answer within {timeout_s:.0f}s") from error
                time.sleep(_RETRY_S)

    def _wait_for_a_run(self, data_address: str) -> pb.RegisterReply:
        """Register with the router's active run once there is one that needs this rank."""
        while True:
            try:
                return self._register(data_address, timeout_s=float("inf"))
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                log.info("waiting for a run: %s", error.details())
                time.sleep(_WAIT_FOR_RUN_S)

    def _rejoin(self, data_address: str, config) -> bool:
        """After losing the router: register again; True if this process goes on as it is."""
        log.warning("lost the router; registering again")
        try:
            reply = self._register(data_address, config.router.reconnect_timeout_s)
        except (RouterLost, grpc.RpcError) as error:
            log.error("could not register again: %s", error)
            return False
        same = reply.dist_address == self.dist_address and _world_size(
            config_lib.from_yaml(reply.config_yaml), self.pool
        ) == _world_size(config, self.pool)
        if not same:
            log.warning("the router re-formed the %s pool; exiting to be restarted", self.pool)
        return same

    def _join_pool(self, config, dist_address: str) -> None:
        backend = "nccl" if config.train.device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(config.parallel.local_gpu(self.pool, self.rank, torch.cuda.device_count()))
        dist.init_process_group(
            backend,
            init_method=f"tcp://{dist_address}",
            rank=self.rank,
            world_size=_world_size(config, self.pool),
        )

    def _execute(self, service) -> bool:
        """Run commands until told to stop (True) or until the router is lost (False)."""
        commands = self.stub.Commands(
            pb.CommandStreamRequest(run_id=self.run_id, worker=self.worker, worker_key=self.worker_key)
        )
        try:
            for command in commands:
                self.last_command = command.seq or self.last_command
                kind = command.WhichOneof("command")
                if kind == "stop":
                    log.info("stopping: %s", command.stop.reason)
                    return True
                if kind == "setup":
                    self.generation = command.setup.generation
                self._gc.take()
                try:
                    with self._profiled(command):
                        result = getattr(service, kind)(getattr(command, kind))
                except Exception as error:  # noqa: BLE001 - reported to the router, then this worker exits
                    self._report_failure(error)
                    raise
                _log_gc_pauses(kind, self._gc.take())
                if result is not None:
                    self._report(**{kind: result})
        except grpc.RpcError as error:
            log.warning("command stream broke: %s", error.code())
            return False
        return False

    def _report_failure(self, error: Exception) -> None:
        """The traceback being handled, and whether a restart would fail the same way; logged here
        first, since the exception may never reach the interpreter's own report (cleaning up after
        it can hang in a collective until the heartbeat thread ends the process)."""
        text = traceback.format_exc()
        log.error("failed (reported to the router): %s", text.rstrip())
        self._report(error=text, error_repeats=would_repeat(error))

    def _report(self, **result) -> None:
        self.stub.ReportResult(
            pb.WorkerResult(
                run_id=self.run_id, worker=self.worker, generation=self.generation,
                worker_key=self.worker_key, **result,
            ),
            timeout=30,
        )

    def _heartbeat(self, interval_s: float, grace_s: float) -> None:
        """Beat while the process lives; end it if it is still here `grace_s` after the router
        released it (or as long as the router's release named, if shorter), or after its main
        thread began to clean up (see the module's docstring)."""
        pulse = _Pulse(os.environ.get(PULSE_FD_ENV))
        released_at = None
        while True:
            pulse()
            time.sleep(interval_s)
            ending = self._stopped.is_set()
            released, exit_within_s = (True, 0.0) if ending else self._released(timeout_s=interval_s * 5)
            now = time.monotonic()
            if not released:
                released_at = None
                continue
            if released_at is None:
                released_at, allowed_s = now, grace_s
            allowed_s = min(allowed_s, exit_within_s or grace_s)
            if now - released_at > allowed_s:
                log.error(
                    "%s %.0fs ago and still running (stuck?): exiting",
                    "stopped" if ending else "released by the router", now - released_at,
                )
                logging.shutdown()
                os._exit(STUCK_EXIT_CODE)  # the main thread cannot be interrupted

    def _released(self, timeout_s: float) -> tuple[bool, float]:
        """One heartbeat: whether the router no longer counts on this process, and how long it
        gave the process to end (0: router.stop_grace_s)."""
        request = pb.HeartbeatRequest(
            run_id=self.run_id, worker=self.worker, generation=self.generation, worker_key=self.worker_key
        )
        try:
            reply = self.stub.Heartbeat(request, timeout=timeout_s)
        except grpc.RpcError as error:
            log.debug("heartbeat failed: %s", error.code())
            return error.code() in _RELEASED, 0.0
        return reply.stop, reply.exit_within_s


def _log_gc_pauses(kind: str, pauses) -> None:
    """Garbage collection that held a command for a millisecond or more: its launches stalled
    (and its GPU, once the queued kernels ran out) that long."""
    if pauses.seconds >= _GC_PAUSE_LOGGED_S:
        log.info("garbage collection held this %s %.1f ms (%d collections, up to generation %d)",
                 kind, pauses.seconds * 1e3, pauses.collections, pauses.oldest_generation)


class _Pulse:
    """One byte down the pod supervisor's pipe per call; nothing outside a pod. Never blocks: a
    full pipe already says that this process is alive."""

    def __init__(self, fd: str | None):
        self.fd = int(fd) if fd else None
        if self.fd is not None:
            os.set_blocking(self.fd, False)

    def __call__(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(BlockingIOError, BrokenPipeError):  # full; or the supervisor is gone
                os.write(self.fd, b".")


class StepProfiler:
    """Profiles the step named in $DYAD_PROFILE_STEP (and its apply) into $DYAD_PROFILE_DIR as a
    kernel table and a timeline (Chrome trace) per worker: where each pool's time goes, for
    bench/e2e_hetero.py. Read once, when the process starts; without them, a no-op."""

    def __init__(self, directory: str, step: int, pool: str, rank: int):
        self.directory, self.step, self.name = directory, step, f"{pool}-{rank}"

    @classmethod
    def from_environment(cls, pool: str, rank: int):
        directory, step = os.environ.get("DYAD_PROFILE_DIR"), os.environ.get("DYAD_PROFILE_STEP")
        if not directory or not step:
            return lambda command: contextlib.nullcontext()
        return cls(directory, int(step), pool, rank)

    def __call__(self, command: pb.WorkerCommand):
        kind = command.WhichOneof("command")
        if kind not in ("step", "apply") or getattr(command, kind).step != self.step:
            return contextlib.nullcontext()
        return _ProfileToFile(f"{self.directory}/{self.name}-{kind}{self.step}.txt")


class _ProfileToFile(contextlib.AbstractContextManager):
    def __init__(self, path: str):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.path, self.profile = path, profile(activities=activities)

    def __enter__(self):
        self.profile.__enter__()
        return self

    def __exit__(self, *exc_info):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profile.__exit__(*exc_info)
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        with open(self.path, "w") as f:
            f.write(self.profile.key_averages().table(sort_by=sort, row_limit=25))
        self.profile.export_chrome_trace(self.path.removesuffix(".txt") + ".trace.json")
        return False


def _world_size(config, pool: str) -> int:
    return getattr(config.parallel, pool).world_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dyad.app.worker")
    parser.add_argument("--router", required=True)
    parser.add_argument("--run-id", default="", help="default: the router's active run")
    parser.add_argument("--pool", choices=pool_names(), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--join-token-file", help="default: $DYAD_JOIN_TOKEN")
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # the share its launcher gave it, also where torch was imported before (a fork server's)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.basicConfig(
        level=os.environ.get("DYAD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {args.pool}/{args.rank} %(levelname)s %(message)s",
    )
    try:
        token = load_token("DYAD_JOIN_TOKEN", args.join_token_file)
    except ValueError as error:
        sys.exit(f"dyad worker: {error}")
    WorkerRuntime(args.router, args.run_id, args.pool, args.rank, token).run()


if __name__ == "__main__":
    main()
