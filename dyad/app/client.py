"""The client side: talk to a router, or start one on this machine for the embedded default."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

from dyad.channels import open_channel
from dyad.credentials import CLIENT_TOKEN_ENV, JOIN_TOKEN_ENV
from dyad.pools import pool_type
from dyad.wire import pb, rpc


class RouterClient:
    def __init__(
        self,
        address: str,
        *,
        token: str,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        self.address = address
        self.channel = open_channel(
            address, token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        self.stub = rpc.RouterStub(self.channel)

    def start_run(self, config_yaml: str) -> pb.RunInfo:
        return self.stub.StartRun(pb.StartRunRequest(config_yaml=config_yaml), timeout=60)

    def get_run(self, run_id: str) -> pb.RunInfo:
        return self.stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=10)

    def active_run_id(self) -> str:
        """The run the router drives now; "" when none."""
        return self.stub.GetActiveRun(pb.GetActiveRunRequest(), timeout=10).run_id

    def stop_run(self, run_id: str) -> pb.RunInfo:
        return self.stub.StopRun(pb.StopRunRequest(run_id=run_id), timeout=10)

    def watch(self, run_id: str, from_step: int = 0) -> Iterator[pb.RunEvent]:
        return self.stub.WatchRun(pb.WatchRunRequest(run_id=run_id, from_step=from_step))

    def scale_pool(self, run_id: str, pool: str, replicas: int) -> pb.RunInfo:
        request = pb.ScalePoolRequest(run_id=run_id, pool=pool_type(pool).wire_id, replicas=replicas)
        return self.stub.ScalePool(request, timeout=60)

    def checkpoint(self, run_id: str) -> pb.RunInfo:
        return self.stub.Checkpoint(pb.CheckpointRequest(run_id=run_id), timeout=60)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def local_router(log_path: Path, timeout_s: float = 60.0) -> Iterator[RouterClient]:
    """Start `python -m dyad.router` as a local process with fresh tokens; stop it on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    client_token = secrets.token_urlsafe(32)
    env = {
        **os.environ,
        CLIENT_TOKEN_ENV: client_token,
        JOIN_TOKEN_ENV: secrets.token_urlsafe(32),
    }
    with tempfile.TemporaryDirectory() as tmp, open(log_path, "ab") as log:
        port_file = Path(tmp) / "router.address"
        # The router reads the pipe on its stdin to its end, which comes when this process exits
        # however it ends (killed too): then it stops the run and its workers.
        proc = subprocess.Popen(
            [sys.executable, "-m", "dyad.router", "--port-file", str(port_file), "--stop-when-stdin-closes"],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not port_file.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"the router exited with {proc.returncode}; see {log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router did not start within {timeout_s}s; see {log_path}")
                time.sleep(0.1)
            with RouterClient(port_file.read_text(), token=client_token) as client:
                yield client
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdin.close()
            if proc.returncode != 0:  # SIGTERM ends it cleanly: anything else is worth a look
                print(f"dyad: the local router exited with code {proc.returncode}; see {log_path}", file=sys.stderr)
