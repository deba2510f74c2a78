"""Launcher backends: how the router gets worker processes for a run.

`LocalLauncher` starts one process per rank on this machine. A Kubernetes backend implements
the same interface by scaling StatefulSets.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerSpec:
    pool: str  # "encoder" | "llm"
    rank: int


class Launcher(ABC):
    @abstractmethod
    def start(self, run_id: str, router_address: str, workers: list[WorkerSpec], log_dir: Path) -> None:
        """Start (or scale up to) the given workers."""

    @abstractmethod
    def dead(self) -> list[tuple[WorkerSpec, str]]:
        """Workers that have exited unexpectedly, with a reason."""

    @abstractmethod
    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every worker of the run, waiting up to `timeout_s` before killing."""


class LocalLauncher(Launcher):
    def __init__(self) -> None:
        self._procs: dict[WorkerSpec, subprocess.Popen] = {}
        self._logs: dict[WorkerSpec, Path] = {}
        self._stopping = False

    def start(self, run_id, router_address, workers, log_dir) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self._stopping = False
        rendezvous = {pool: f"127.0.0.1:{_free_port()}" for pool in {spec.pool for spec in workers}}
        for spec in workers:
            log_path = log_dir / f"{spec.pool}-{spec.rank}.log"
            command = [
                sys.executable, "-m", "dyad.worker",
                "--router", router_address, "--run-id", run_id,
                "--pool", spec.pool, "--rank", str(spec.rank),
                "--dist-address", rendezvous[spec.pool],
            ]
            with open(log_path, "ab") as log:
                self._procs[spec] = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)
                )
            self._logs[spec] = log_path

    def dead(self) -> list[tuple[WorkerSpec, str]]:
        if self._stopping:
            return []
        found = []
        for spec, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                found.append((spec, f"exited with code {code}; last lines of {self._logs[spec]}:\n"
                              f"{_tail(self._logs[spec])}"))
        return found

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for workers told to stop to exit; terminate, then kill, the ones that do not."""
        self._stopping = True
        for proc in self._procs.values():
            for signal_them, wait_s in ((None, timeout_s), (proc.terminate, 5.0), (proc.kill, None)):
                if proc.poll() is not None:
                    break
                if signal_them:
                    signal_them()
                try:
                    proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    continue
        self._procs.clear()

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
