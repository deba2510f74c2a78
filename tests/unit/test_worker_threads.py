"""Workers that share a machine or a pod each get their share of its CPUs, unless the user says."""

from __future__ import annotations

import pytest

import dyad.app.pod
from dyad.cpus import cgroup_cpu_quota, usable_cpus, worker_environment, worker_threads
from dyad.ucx_progress import PROGRESS_ENV, busy_threads, worker_progress_env


def test_each_worker_gets_its_share_of_the_cpus():
    assert worker_threads(cpus=128, workers=16) == 8
    assert worker_threads(cpus=128, workers=9) == 14
    assert worker_threads(cpus=2, workers=3) == 1  # never zero
    assert worker_threads(cpus=4, workers=0) == 4


def test_a_polling_ucx_progress_thread_keeps_its_core():
    assert worker_threads(cpus=128, workers=16, busy_per_worker=1) == 7
    assert worker_threads(cpus=16, workers=2, busy_per_worker=1) == 7
    assert worker_threads(cpus=2, workers=3, busy_per_worker=1) == 1  # never zero
    assert busy_threads({PROGRESS_ENV: "thread-polling"}) == 1
    assert busy_threads({PROGRESS_ENV: "thread"}) == 0
    with pytest.raises(ValueError, match=PROGRESS_ENV):
        busy_threads({PROGRESS_ENV: "polling"})


def test_the_router_names_its_workers_progress_mode_from_the_runs_device():
    """The router does not import torch to ask whether CUDA is present: a run on CUDA polls, a
    CPU run sleeps, and a mode the router's environment names is left to the workers."""
    assert worker_progress_env("cuda", {}) == {PROGRESS_ENV: "thread-polling"}
    assert worker_progress_env("cpu", {}) == {PROGRESS_ENV: "thread"}
    assert worker_progress_env("cuda", {PROGRESS_ENV: "thread"}) == {}
    assert busy_threads(worker_progress_env("cuda", {})) == 1


def test_the_users_setting_wins():
    assert worker_environment({"PATH": "/bin"}, {}, 8) == {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "8",
        "THP_MEM_ALLOC_ENABLE": "1",
    }
    assert worker_environment({"OMP_NUM_THREADS": "3"}, {}, 8)["OMP_NUM_THREADS"] == "3"
    assert worker_environment({"THP_MEM_ALLOC_ENABLE": "0"}, {}, 8)["THP_MEM_ALLOC_ENABLE"] == "0"
    assert worker_environment({}, {"OMP_NUM_THREADS": "2", "DYAD_JOIN_TOKEN": "t"}, 8) == {
        "OMP_NUM_THREADS": "2",
        "THP_MEM_ALLOC_ENABLE": "1",
        "DYAD_JOIN_TOKEN": "t",
    }


def test_a_pods_cpu_limit_caps_the_cpus(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("250000 100000\n")  # limits.cpu: 2500m
    assert cgroup_cpu_quota(cpu_max) == 3
    assert usable_cpus(cpu_max) == min(3, usable_cpus(tmp_path / "absent"))
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpu_quota(cpu_max) is None
    assert cgroup_cpu_quota(tmp_path / "absent") is None
    cpu_max.write_text("garbage")
    assert cgroup_cpu_quota(cpu_max) is None


@pytest.mark.parametrize("progress,share", [("thread", "4"), ("thread-polling", "3")])
def test_a_pods_workers_get_their_share(monkeypatch, progress, share):
    started = []

    class FakeWorker:
        returncode = 0

        def __init__(self, command, env, pass_fds=()):
            started.append(env)

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    class FakeHealth:  # the server and its servicer
        def stop(self, grace):
            pass

        def set(self, service, status):
            pass

    monkeypatch.setattr(dyad.app.pod.subprocess, "Popen", FakeWorker)
    monkeypatch.setattr(dyad.app.pod, "_serve_health", lambda port: (FakeHealth(), FakeHealth()))
    monkeypatch.setattr(dyad.app.pod, "usable_cpus", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name, value in {
        "POD_NAME": "dyad-llm-0",
        "DYAD_GPUS_PER_POD": "4",
        "DYAD_ROUTER": "r:1",
        "DYAD_JOIN_TOKEN": "t",
        PROGRESS_ENV: progress,
    }.items():
        monkeypatch.setenv(name, value)
    assert dyad.app.pod.run_pod("llm") == 0
    assert [env["OMP_NUM_THREADS"] for env in started] == [share] * 4
