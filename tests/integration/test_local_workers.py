"""The local launcher's two ways of starting a worker: a fresh `python -m dyad.app.worker` (where
the machine has GPUs) and a fork of the fork server that has imported torch (where it has none;
every job test runs those). Either way the worker gets the environment and the log a fresh process
would, and its exit code and last lines come back through `dead()`; `stop` ends a running one."""

from __future__ import annotations

import os
import time

import pytest

from dyad.router.launcher import LocalLauncher, WorkerSpec


@pytest.mark.parametrize("fork_server", [False, True], ids=["fresh-process", "forked"])
def test_a_worker_that_exits_is_reported_with_its_code_and_log(tmp_path, fork_server):
    launcher = LocalLauncher(fork_server=fork_server)
    # no such pool: the worker's argument parser refuses it and exits with code 2
    launcher.start("run", "127.0.0.1:1", [WorkerSpec("no-such-pool", 0)], tmp_path, env={"DYAD_MARK": "1"})
    deadline = time.monotonic() + 120
    while not (dead := launcher.dead()):
        assert time.monotonic() < deadline, "the worker did not exit"
        time.sleep(0.1)
    [(spec, report)] = dead
    assert spec == WorkerSpec("no-such-pool", 0)
    assert report.startswith("exited with code 2") and "invalid choice: 'no-such-pool'" in report, report
    assert "invalid choice" in (tmp_path / "no-such-pool-0.log").read_text()


@pytest.mark.parametrize("fork_server", [False, True], ids=["fresh-process", "forked"])
def test_a_running_worker_is_stopped(tmp_path, fork_server):
    launcher = LocalLauncher(fork_server=fork_server)
    # a router that never answers: the worker waits to register until it is stopped
    launcher.start("run", "127.0.0.1:9", [WorkerSpec("llm", 0)], tmp_path, env={"DYAD_JOIN_TOKEN": "x"})
    pid = launcher.pid(WorkerSpec("llm", 0))
    launcher.stop(timeout_s=1)  # no grace to speak of: then SIGTERM
    assert launcher.dead() == [] and launcher.pid(WorkerSpec("llm", 0)) is None
    with pytest.raises(ProcessLookupError):  # ended and reaped
        os.kill(pid, 0)
