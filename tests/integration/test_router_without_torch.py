"""The router decides and never touches a tensor, so it runs without torch: its process starts in
a fraction of a second instead of the two torch's import takes, and holds no torch in memory.
Here a router process in which `import torch` fails runs a whole job (a committed checkpoint,
the final one) while its workers train with torch as usual."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dyad import config as config_lib
from dyad.app.client import RouterClient
from tests.helpers.resilience import CREDENTIALS, follow, job_config

# `import torch` raises ModuleNotFoundError wherever it runs in this process.
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; from dyad.router.__main__ import main; main()"


def _router_without_torch(tmp_path) -> tuple[subprocess.Popen, str]:
    port_file = tmp_path / "router.address"
    env = os.environ | {"DYAD_TOKEN": CREDENTIALS.client_token, "DYAD_JOIN_TOKEN": CREDENTIALS.join_token}
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", WITHOUT_TORCH, "--port", "0", "--port-file", str(port_file)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None, (tmp_path / "router.log").read_text()
        assert time.monotonic() < deadline, "the router did not start"
        time.sleep(0.05)
    return proc, port_file.read_text()


def test_a_router_that_cannot_import_torch_runs_a_job(tmp_path):
    router, address = _router_without_torch(tmp_path)
    client = RouterClient(address, token=CREDENTIALS.client_token)
    try:
        config = job_config(tmp_path / "run", "train.steps=3")
        run = follow(client, client.start_run(config_lib.to_yaml(config)).run_id)
    finally:
        client.close()
        router.terminate()
        router.wait(30)
    log = (tmp_path / "router.log").read_text()
    assert run.info.state == 3, (run.info.message, log[-3000:])  # finished
    assert sorted(run.steps) == [0, 1, 2]
    assert [n.step for n in run.notices if n.kind == "checkpoint"] == [2, 3], run.notices
    assert "torch" not in log, log[-3000:]
