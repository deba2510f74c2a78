"""A pool pod's entry point (`dyad worker --pool llm`): one worker process per GPU of the pod,
a grpc.health.v1 server for the kubelet's probes, and the pod's lifetime tied to its workers'.

The pod's StatefulSet ordinal (the suffix of `$POD_NAME`) and `$DYAD_GPUS_PER_POD` (N) give its
ranks `ordinal*N .. ordinal*N + N-1`. When any worker exits (the router told it to stop because
its pool re-forms, or it failed), the others are stopped and the pod's process exits with that
code, so the container restarts as a whole and its workers register again; the restart count the
router's Kubernetes backend watches then says what happened.

A stuck worker ends the same way: one the router released but whose main thread cannot obey
exits by itself (dyad/app/worker.py), and one frozen whole (no heartbeat thread either: no pulse down
its pipe for `$DYAD_WORKER_SILENT_S`, once it has pulsed) is killed here. Either way the health
service says NOT_SERVING from then on and stops with the pod's process, so the kubelet's
liveness probe fails only if this supervisor itself hangs; the container restarts because its
process exits. The router never deletes a pod.

Environment: `DYAD_ROUTER` (host:port), `DYAD_JOIN_TOKEN`, `POD_NAME`, `POD_IP`,
`DYAD_GPUS_PER_POD` (default 1), optional `DYAD_RUN_ID` (default: the router's active run),
`DYAD_WORKER_SILENT_S` (default 60, the router's default worker_timeout_s; keep it above
6 x router.heartbeat_interval_s). In a LeaderWorkerSet group (experimental `k8s/overlays/lws`)
the ordinal comes from `DYAD_LWS_GROUP_INDEX`, `LWS_GROUP_SIZE` and `LWS_WORKER_INDEX` instead of
the pod name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dyad.cpus import usable_cpus, worker_environment, worker_threads
from dyad.ucx_progress import busy_threads

log = logging.getLogger("dyad.app.pod")
HEALTH_PORT = 8081
PULSE_FD_ENV = "DYAD_PULSE_FD"  # a worker's end of its pipe to this supervisor
STUCK_EXIT_CODE = 3  # a worker stuck (released, still running) or frozen (silent)
_STOP_GRACE_S = 20.0


def pod_ranks(pod_name: str, gpus_per_pod: int) -> list[int]:
    """The pool ranks of the StatefulSet pod `<name>-<ordinal>`."""
    head, _, ordinal = pod_name.rpartition("-")
    if not head or not ordinal.isdigit():
        raise ValueError(f"POD_NAME must end in a StatefulSet ordinal (<name>-<n>), got {pod_name!r}")
    if gpus_per_pod < 1:
        raise ValueError(f"DYAD_GPUS_PER_POD must be >= 1, got {gpus_per_pod}")
    first = int(ordinal) * gpus_per_pod
    return list(range(first, first + gpus_per_pod))


def pod_ordinal_name(environ) -> str:
    """`$POD_NAME`, or for a LeaderWorkerSet replica (`$LWS_GROUP_SIZE` set) a StatefulSet-like
    name whose ordinal is group_index * group_size + worker_index."""
    if environ.get("LWS_GROUP_SIZE"):
        ordinal = int(environ["DYAD_LWS_GROUP_INDEX"]) * int(environ["LWS_GROUP_SIZE"]) + int(
            environ.get("LWS_WORKER_INDEX", "0")
        )
        return f"lws-{ordinal}"
    return _env("POD_NAME", environ)


def _env(name: str, environ=os.environ) -> str:
    value = environ.get(name, "")
    if not value:
        raise ValueError(f"${name} must be set (see dyad/app/pod.py)")
    return value


def _serve_health(port: int) -> tuple[grpc.Server, health.HealthServicer]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if server.add_insecure_port(f"0.0.0.0:{port}") == 0:
        raise OSError(f"cannot serve health on port {port}")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, servicer


class _Pulses:
    """The read end of a worker's pulse pipe and when it last carried something."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.last: float | None = None  # None until the worker's first pulse

    def silent_for(self, now: float) -> float:
        with contextlib.suppress(BlockingIOError):  # nothing new since the last look
            if os.read(self.read_fd, 4096):
                self.last = now
        return 0.0 if self.last is None else now - self.last


def run_pod(pool: str, health_port: int = HEALTH_PORT) -> int:
    """Start the pod's workers; return the exit code of the first one to exit (STUCK_EXIT_CODE
    when one is killed for being silent)."""
    ranks = pod_ranks(pod_ordinal_name(os.environ), int(os.environ.get("DYAD_GPUS_PER_POD", "1")))
    router = _env("DYAD_ROUTER")
    _env("DYAD_JOIN_TOKEN")  # the workers read it; refuse early when it is missing
    run_id = os.environ.get("DYAD_RUN_ID", "")
    silent_s = float(os.environ.get("DYAD_WORKER_SILENT_S", "60"))
    health_server, health_servicer = _serve_health(health_port)
    threads = worker_threads(usable_cpus(), len(ranks), busy_threads(os.environ))
    env = worker_environment(os.environ, {}, threads)
    pulses = {rank: _Pulses() for rank in ranks}
    workers = {
        rank: subprocess.Popen(
            [sys.executable, "-m", "dyad.app.worker", "--router", router, "--pool", pool,
             "--rank", str(rank), "--run-id", run_id],
            env=env | {PULSE_FD_ENV: str(pipe.write_fd)}, pass_fds=(pipe.write_fd,),
        )
        for rank, pipe in pulses.items()
    }
    for pipe in pulses.values():
        os.close(pipe.write_fd)
    log.info("%s pod: ranks %s", pool, ranks)
    exited = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: exited.set())
    code = 0
    while not exited.wait(1.0):
        done = {rank: proc.returncode for rank, proc in workers.items() if proc.poll() is not None}
        if done:
            rank, code = next(iter(done.items()))
            log.info("worker %s/%d exited with %s; stopping the pod's other workers", pool, rank, code)
            break
        now = time.monotonic()
        silent = [rank for rank, pipe in pulses.items() if pipe.silent_for(now) > silent_s]
        if silent:
            rank, code = silent[0], STUCK_EXIT_CODE
            log.error("worker %s/%d silent for more than %gs (frozen): killing it and stopping "
                      "the pod's other workers", pool, rank, silent_s)
            workers[rank].kill()  # frozen: SIGTERM could wait for ever (a stopped process)
            break
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    for proc in workers.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in workers.values():
        try:
            proc.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pipe in pulses.values():
        os.close(pipe.read_fd)
    health_server.stop(grace=None)
    return code
