"""A pool pod (`dyad worker`) derives its ranks from its StatefulSet ordinal, starts one worker
per GPU that joins the router's active run without being told its id, and answers the kubelet's
grpc health probes; a stuck or frozen worker ends the pod (its container restarts), since the
router deletes no pod."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dyad.app.pod import STUCK_EXIT_CODE, pod_ordinal_name, pod_ranks
from dyad.router.launcher import free_ports
from tests.helpers.launchers import LostOnRequest, NoWorkers
from tests.helpers.resilience import CREDENTIALS, job_config


def test_ranks_come_from_the_ordinal():
    assert pod_ranks("dyad-llm-0", 1) == [0]
    assert pod_ranks("dyad-llm-3", 2) == [6, 7]
    for name in ("dyad-llm", "dyad-llm-x", "7"):
        with pytest.raises(ValueError, match="POD_NAME"):
            pod_ranks(name, 1)
    with pytest.raises(ValueError, match="DYAD_GPUS_PER_POD"):
        pod_ranks("dyad-llm-0", 0)


def test_a_leaderworkerset_pod_counts_its_group():
    environ = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "DYAD_LWS_GROUP_INDEX": "3",
               "POD_NAME": "dyad-llm-3-1"}
    assert pod_ranks(pod_ordinal_name(environ), 4) == [28, 29, 30, 31]  # ordinal 3*2+1 = 7
    assert pod_ordinal_name({"POD_NAME": "dyad-llm-5"}) == "dyad-llm-5"


class PodUnderTest:
    """A router (that starts no workers) with a run of four LLM ranks, and the pod dyad-llm-1
    (ranks 2 and 3) as a `dyad worker` process."""

    def __init__(self, tmp_path, *overrides: str, launcher_factory=NoWorkers, **env: str):
        from dyad import config as config_lib
        from dyad.app.client import RouterClient
        from dyad.router.server import serve

        self.server, self.state = serve(launcher_factory=launcher_factory, credentials=CREDENTIALS)
        self.client = RouterClient(self.state.address, token=CREDENTIALS.client_token)
        self.health_port = free_ports(1)[0]
        config = job_config(
            tmp_path / "run", "parallel.llm.dp=4", "train.microbatches=1", *overrides
        )
        self.run = self.state.get(self.client.start_run(config_lib.to_yaml(config)).run_id)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dyad.app.cli", "worker", "--pool", "llm",
             "--health-port", str(self.health_port)],
            env=os.environ | {
                "POD_NAME": "dyad-llm-1", "DYAD_GPUS_PER_POD": "2", "POD_IP": "127.0.0.1",
                "DYAD_ROUTER": self.state.address, "DYAD_JOIN_TOKEN": CREDENTIALS.join_token,
            } | env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )

    def wait_registered(self, timeout_s: float = 300.0) -> None:  # a hang's bound, not a pace
        deadline = time.monotonic() + timeout_s
        while {("llm", 2), ("llm", 3)} - set(self.run.registered()):
            assert self.process.poll() is None, self.output()
            assert time.monotonic() < deadline, "the pod's workers did not register"
            time.sleep(0.2)

    def health(self) -> str:
        """What the kubelet's gRPC probe would get: a status name, or the RPC's error code."""
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            except grpc.RpcError as error:
                return error.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def output(self) -> str:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.stdout.read().decode()[-3000:]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.client.close()
        for run_id in self.state.active_run_ids():
            self.state.get(run_id).stop_requested.set()
        self.state.wait_idle(10)
        self.server.stop(grace=None)


@pytest.fixture
def pod_under_test(tmp_path):
    """Makes the PodUnderTest of a test (one), and closes it after the test."""
    pods = []

    def make(*overrides: str, launcher_factory=NoWorkers, **env: str) -> PodUnderTest:
        pods.append(PodUnderTest(tmp_path, *overrides, launcher_factory=launcher_factory, **env))
        return pods[-1]

    yield make
    for pod in pods:
        pod.close()


def test_a_pod_joins_the_active_run_with_its_ranks_and_reports_health(pod_under_test):
    pod = pod_under_test()
    pod.wait_registered()
    assert set(pod.run.registered()) == {("llm", 2), ("llm", 3)}
    assert pod.health() == "SERVING"
    pod.process.send_signal(signal.SIGTERM)
    assert pod.process.wait(60) is not None


def test_a_frozen_worker_is_killed_and_the_pod_stops_serving(pod_under_test):
    """A worker frozen whole (here SIGSTOP; in life e.g. a C call holding the GIL) sends no
    heartbeat and no pulse: its supervisor kills it, says NOT_SERVING and exits."""
    pod = pod_under_test(DYAD_WORKER_SILENT_S="3")
    pod.wait_registered()
    assert pod.health() == "SERVING"
    frozen = pod.run.registered()[("llm", 2)].pid
    time.sleep(1.0)  # its heartbeat thread has pulsed
    os.kill(frozen, signal.SIGSTOP)
    try:
        code = pod.process.wait(30)
    except subprocess.TimeoutExpired:
        code = None
    output = pod.output()
    assert code == STUCK_EXIT_CODE, output
    assert "worker llm/2 silent for more than 3s (frozen)" in output
    assert pod.health() == "UNAVAILABLE"  # nothing answers the probe; the container restarts
    with pytest.raises(ProcessLookupError):
        os.kill(frozen, 0)  # killed and reaped


def test_a_released_worker_whose_main_thread_is_stuck_exits(pod_under_test):
    """The pod's workers register, then block in the pool's rendezvous (no rank 0 comes). Once
    the router sees the other ranks gone (when the test says so: no deadline of the test's own
    decides it), it recovers with a generation without the pod's workers; from then on their
    heartbeats are answered `stop`, and router.abort_grace_s later (1 s), not
    router.stop_grace_s (600 s here), they exit."""
    lost = threading.Event()
    pod = pod_under_test(
        "router.start_timeout_s=600", "router.stop_grace_s=600", "router.max_recoveries=100",
        launcher_factory=lambda: LostOnRequest(lost, elsewhere={("llm", 2), ("llm", 3)}),
    )
    pod.wait_registered()
    lost.set()
    # Within half of stop_grace_s: only the abort grace can have ended them.
    assert pod.process.wait(300) == STUCK_EXIT_CODE, pod.output()
    output = pod.output()
    assert "released by the router" in output and "still running (stuck?): exiting" in output
    assert pod.run.generation > 1  # the router recovered
