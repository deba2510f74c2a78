"""Launcher backends: how the router gets worker processes for a run.

`LocalLauncher` runs one process per rank on this machine. A Kubernetes backend implements the
same interface by scaling StatefulSets (whose controller restarts a pod's process when it
exits, as `start` does here).

On a machine without GPUs the local workers are forked from a fork server that has imported
torch once (multiprocessing's, `WORKER_PRELOAD`): a worker then starts in a fraction of a second
instead of the ~7 s of CPU that importing torch and torch._dynamo (which the optimizer imports)
takes each process. Where there are GPUs each worker is a fresh `python -m dyad.app.worker`: a
fork server that had touched CUDA could not give its children a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dyad.cpus import usable_cpus, worker_environment, worker_threads
from dyad.ucx_progress import busy_threads


@dataclass(frozen=True)
class WorkerSpec:
    pool: str  # "encoder" | "llm"
    rank: int


class Launcher(ABC):
    # The most worker processes (all pools together) this launcher runs for a run: a run or a
    # resize that needs more is refused when it is asked for, naming its layouts.
    max_workers: int = 1024

    @abstractmethod
    def rendezvous(self, pools: Iterable[str]) -> dict[str, str]:
        """A fresh torch.distributed rendezvous "host:port" for each pool's next generation
        (its rank 0 hosts the store there)."""

    @abstractmethod
    def start(
        self, run_id: str, router_address: str, workers: list[WorkerSpec], log_dir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        """Make sure each of `workers` has a running process (start those that have none)."""

    @abstractmethod
    def dead(self) -> list[tuple[WorkerSpec, str]]:
        """Workers that exited without being told to, with a reason."""

    @abstractmethod
    def stop(self, pools: Iterable[str] | None = None, timeout_s: float = 10.0) -> None:
        """Stop the workers of `pools` (all: None), told to stop already: wait up to
        `timeout_s` for them to exit, then terminate, then kill."""

    def adopt(self, spec: WorkerSpec, pid: int) -> None:
        """A worker process an earlier router of this run started (after a router restart)."""


class _Adopted:
    """A process this launcher did not start: polled and signalled by pid."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return -1
        except PermissionError:
            return None
        return -1 if _is_zombie(self.pid) else None

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.1)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


def local_max_workers() -> int:
    """How many worker processes one machine runs: a few per CPU, as the CPU tests do (each
    process then gets one thread); a GPU run needs far fewer."""
    return max(16, 4 * usable_cpus())


# What the fork server imports before it forks a worker: what every worker imports first.
WORKER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.optim"]


def _without_gpus() -> bool:
    return not Path("/dev/nvidiactl").exists()


class _Forked:
    """A worker forked from the fork server, behind the part of Popen's interface used here."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout)

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()


def _run_forked_worker(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """A forked worker's life: the environment and log a fresh process would have, then the
    worker's main module as `python -m dyad.app.worker` runs it."""
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.argv = ["python -m dyad.app.worker", *argv]
    runpy.run_module("dyad.app.worker", run_name="__main__", alter_sys=True)


class LocalLauncher(Launcher):
    def __init__(self, max_workers: int | None = None, *, fork_server: bool | None = None) -> None:
        """`fork_server`: fork the workers from a fork server that has imported torch (default:
        where this machine has no GPU)."""
        self.max_workers = max_workers or local_max_workers()
        self._procs: dict[WorkerSpec, subprocess.Popen | _Forked | _Adopted] = {}
        self._logs: dict[WorkerSpec, Path] = {}
        self._fork_server = _without_gpus() if fork_server is None else fork_server

    def rendezvous(self, pools):
        return {pool: f"127.0.0.1:{port}" for pool, port in zip(pools, free_ports(len(pools)))}

    def start(self, run_id, router_address, workers, log_dir, env=None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        alive = {spec for spec, proc in self._procs.items() if proc.poll() is None} | set(workers)
        busy = busy_threads(os.environ | (env or {}))
        threads = worker_threads(usable_cpus(), len(alive), busy)
        env = worker_environment(os.environ, env or {}, threads)
        for spec in workers:
            running = self._procs.get(spec)
            if running is not None and running.poll() is None:
                continue
            log_path = log_dir / f"{spec.pool}-{spec.rank}.log"
            argv = ["--router", router_address, "--run-id", run_id, "--pool", spec.pool, "--rank", str(spec.rank)]
            if self._fork_server:
                self._procs[spec] = self._fork(argv, env, log_path)
            else:
                with open(log_path, "ab") as log:
                    self._procs[spec] = subprocess.Popen(
                        [sys.executable, "-m", "dyad.app.worker", *argv], stdout=log, stderr=subprocess.STDOUT, env=env
                    )
            self._logs[spec] = log_path

    @staticmethod
    def _fork(argv: list[str], env: dict[str, str], log_path: Path) -> _Forked:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(WORKER_PRELOAD)
        process = context.Process(target=_run_forked_worker, args=(argv, env, str(log_path)), daemon=False)
        process.start()
        return _Forked(process)

    def adopt(self, spec: WorkerSpec, pid: int) -> None:
        if pid > 0 and spec not in self._procs:
            self._procs[spec] = _Adopted(pid)

    def pid(self, spec: WorkerSpec) -> int | None:
        proc = self._procs.get(spec)
        return None if proc is None else proc.pid

    def dead(self) -> list[tuple[WorkerSpec, str]]:
        found = []
        for spec, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                log = self._logs.get(spec)
                tail = f"; last lines of {log}:\n{_tail(log)}" if log else ""
                found.append((spec, f"exited with code {code}{tail}"))
        return found

    def stop(self, pools=None, timeout_s: float = 10.0) -> None:
        chosen = [s for s in self._procs if pools is None or s.pool in set(pools)]
        deadline = time.monotonic() + timeout_s
        for spec in chosen:
            proc = self._procs.pop(spec)
            for signal_it, wait_s in ((None, None), (proc.terminate, 5.0), (proc.kill, 30.0)):
                if proc.poll() is not None:
                    break
                if signal_it:
                    signal_it()
                try:
                    proc.wait(timeout=wait_s if wait_s else max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    continue


def _is_zombie(pid: int) -> bool:
    """Exited but not reaped (its new parent may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] == "Z"


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_LISTEN_PORT = 10000


def free_ports(count: int) -> list[int]:
    """Distinct ports nothing listens on, chosen below the kernel's ephemeral range.

    A port the kernel hands out for `bind(0)` is released before the worker binds it, and in that
    gap any outgoing connection or `bind(0)` on the machine (UCX listeners, gRPC clients) may be
    given the same number. Ports below the ephemeral range are never handed out by the kernel,
    so only another explicit choice can collide with ours.
    """
    low, high = _LOWEST_LISTEN_PORT, _ephemeral_start()
    if count == 0:
        return []
    if high - low < 10 * count:
        return _kernel_chosen_ports(count)
    chosen: list[int] = []
    for port in random.sample(range(low, high), min(high - low, 50 * count)):
        if port not in chosen and _bindable(port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"no {count} free ports between {low} and {high}")


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _kernel_chosen_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
