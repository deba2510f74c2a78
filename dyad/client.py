"""The client side: talk to a router, or start one on this machine for the embedded default."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import grpc

from dyad.wire import GRPC_OPTIONS, pb, rpc


class RouterClient:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = rpc.RouterStub(self.channel)

    def start_run(self, config_yaml: str) -> pb.RunInfo:
        return self.stub.StartRun(pb.StartRunRequest(config_yaml=config_yaml), timeout=60)

    def get_run(self, run_id: str) -> pb.RunInfo:
        return self.stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=10)

    def stop_run(self, run_id: str) -> pb.RunInfo:
        return self.stub.StopRun(pb.StopRunRequest(run_id=run_id), timeout=10)

    def watch(self, run_id: str, from_step: int = 0) -> Iterator[pb.RunEvent]:
        return self.stub.WatchRun(pb.WatchRunRequest(run_id=run_id, from_step=from_step))

    def close(self) -> None:
        self.channel.close()


@contextlib.contextmanager
def local_router(log_path: Path, timeout_s: float = 60.0) -> Iterator[RouterClient]:
    """Start `python -m dyad.router` as a local process; stop it on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, open(log_path, "ab") as log:
        port_file = Path(tmp) / "router.address"
        proc = subprocess.Popen(
            [sys.executable, "-m", "dyad.router", "--port-file", str(port_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not port_file.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"the router exited with {proc.returncode}; see {log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router did not start within {timeout_s}s; see {log_path}")
                time.sleep(0.1)
            client = RouterClient(port_file.read_text())
            try:
                yield client
            finally:
                client.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
