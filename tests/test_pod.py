"""A pool pod (`dyad worker`) derives its ranks from its StatefulSet ordinal, starts one worker
per GPU that joins the router's active run without being told its id, and answers the kubelet's
grpc health probes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dyad.pod import pod_ordinal_name, pod_ranks
from dyad.router.launcher import free_ports
from tests.resilience import CREDENTIALS, job_config
from tests.test_router import NoWorkers


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


def test_a_pod_joins_the_active_run_with_its_ranks_and_reports_health(tmp_path):
    from dyad import config as config_lib
    from dyad.client import RouterClient
    from dyad.router.server import serve

    server, state = serve(launcher_factory=NoWorkers, credentials=CREDENTIALS)
    client = RouterClient(state.address, token=CREDENTIALS.client_token)
    health_port = free_ports(1)[0]
    pod = None
    try:
        config = job_config(tmp_path / "run", "parallel.llm.dp=4", "train.microbatches=1")
        run = state.get(client.start_run(config_lib.to_yaml(config)).run_id)
        env = os.environ | {
            "POD_NAME": "dyad-llm-1", "DYAD_GPUS_PER_POD": "2", "DYAD_ROUTER": state.address,
            "DYAD_JOIN_TOKEN": CREDENTIALS.join_token, "POD_IP": "127.0.0.1",
        }
        pod = subprocess.Popen(
            [sys.executable, "-m", "dyad.cli", "worker", "--pool", "llm",
             "--health-port", str(health_port)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while {("llm", 2), ("llm", 3)} - set(run.registered()):
            assert pod.poll() is None, pod.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the pod's workers did not register"
            time.sleep(0.2)
        assert set(run.registered()) == {("llm", 2), ("llm", 3)}
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        pod.send_signal(signal.SIGTERM)
        assert pod.wait(60) is not None
    finally:
        if pod is not None and pod.poll() is None:
            pod.kill()
        client.close()
        for run_id in state.active_run_ids():
            state.get(run_id).stop_requested.set()
        state.wait_idle(10)
        server.stop(grace=None)
