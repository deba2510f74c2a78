"""A killed worker's peers report errors of their own (UCX's "Request canceled") that often reach
the router before it sees the death: the failure is put down to the worker whose process exited
or went silent, with the peers' errors after it as consequences, whichever came first. The
router here has a fake launcher and a queue of forged results."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

from dyad.pools import pool_type
from dyad.router import driver as driver_lib
from dyad.router.driver import RunAborted, RunDriver, WorkerLost
from dyad.router.failures import blame
from dyad.wire import pb

CANCELED = "Traceback (most recent call last):\n  ...\nConnectionError: recv of a tag from 127.0.0.1:4000 failed: UCXCanceledError('Request canceled')"
WORKERS = [("encoder", 0), ("llm", 0), ("llm", 1)]


def _error(key, text=CANCELED, repeats=False) -> pb.WorkerResult:
    pool, rank = key
    return pb.WorkerResult(
        run_id="run", worker=pb.WorkerId(pool=pool_type(pool).wire_id, rank=rank), generation=1,
        error=text, error_repeats=repeats,
    )


class _Launcher:
    """Shows each death once `dead()` has been asked `after` times (a pod watch that lags)."""

    def __init__(self, deaths=(), after: int = 0):
        self.deaths, self.after, self.asked = list(deaths), after, 0

    def dead(self):
        self.asked += 1
        if self.asked <= self.after:
            return []
        return [(SimpleNamespace(pool=pool, rank=rank), reason) for (pool, rank), reason in self.deaths]


def _pool_name(wire_id: int) -> str:
    return next(name for name in ("encoder", "llm") if pool_type(name).wire_id == wire_id)


def _driver(launcher, queued=(), silent=()) -> RunDriver:
    """A driver whose run has WORKERS registered (those `silent` last heard of long ago) and
    `queued` results waiting; each error result is on record as its worker's failure."""
    results = queue.Queue()
    failures = {}
    for result in queued:
        results.put(result)
        failures[(_pool_name(result.worker.pool), result.worker.rank)] = result
    now = time.monotonic()
    run = SimpleNamespace(
        registered=lambda: {key: SimpleNamespace(last_seen=now - (100 if key in silent else 0)) for key in WORKERS},
        generation=1,
        results=results,
        stop_requested=threading.Event(),
        config=SimpleNamespace(router=SimpleNamespace(step_timeout_s=10.0, worker_timeout_s=60.0)),
        failure_of=failures.get,
    )
    driver = object.__new__(RunDriver)
    driver.run, driver.launcher = run, launcher
    driver.step, driver._early = 0, []
    return driver


def test_a_dead_worker_is_blamed_before_the_peers_that_reported_its_consequences():
    verdict = blame(
        [(("llm", 0), "exited with code -9")],
        {("encoder", 0): _error(("encoder", 0)), ("llm", 1): _error(("llm", 1))},
        "its step", reporter=("encoder", 0),
    )
    assert not verdict.repeats
    assert verdict.message.splitlines() == [
        "worker llm/0 exited with code -9",
        "then encoder/0 failed: ConnectionError: recv of a tag from 127.0.0.1:4000 failed: UCXCanceledError('Request canceled')",
        "then llm/1 failed: ConnectionError: recv of a tag from 127.0.0.1:4000 failed: UCXCanceledError('Request canceled')",
    ]


def test_a_peers_error_that_arrives_first_does_not_take_the_blame():
    driver = _driver(_Launcher([(("llm", 0), "exited with code -9")]), [_error(("encoder", 0))])
    with pytest.raises(WorkerLost) as lost:
        driver._collect("step", lambda result: True)
    first, *then = str(lost.value).splitlines()
    assert first == "worker llm/0 exited with code -9"
    assert then == [f"then encoder/0 failed: {CANCELED.splitlines()[-1]}"]


def test_a_death_the_launcher_shows_late_is_waited_for(monkeypatch):
    monkeypatch.setattr(driver_lib, "_POLL_S", 0.01)
    launcher = _Launcher([(("llm", 0), "(pod llm-0) exited")], after=5)
    with pytest.raises(WorkerLost, match=r"^worker llm/0 \(pod llm-0\) exited\nthen encoder/0 failed"):
        _driver(launcher, [_error(("encoder", 0))])._collect("step", lambda result: True)


def test_with_no_death_in_sight_the_reporter_is_blamed_after_a_bounded_wait(monkeypatch):
    monkeypatch.setattr(driver_lib, "_DEATH_SEEN_WITHIN_S", 0.3)
    started = time.monotonic()
    with pytest.raises(WorkerLost) as lost:
        _driver(_Launcher(), [_error(("encoder", 0), "Traceback...\nRuntimeError: a bug")])._collect("step", lambda r: True)
    assert 0.3 <= time.monotonic() - started < 5
    headline, traceback = str(lost.value).split("\n", 1)
    assert headline == "worker encoder/0 failed: RuntimeError: a bug" and traceback.startswith("Traceback")


def test_exits_are_blamed_on_the_worker_that_said_nothing():
    """encoder/0 reported its canceled transfer and exited; llm/0 was killed: llm/0 is named
    first, whichever exit the launcher lists first."""
    launcher = _Launcher([(("encoder", 0), "exited with code 1"), (("llm", 0), "exited with code -9")])
    driver = _driver(launcher)
    driver.run.failure_of = {("encoder", 0): _error(("encoder", 0))}.get
    with pytest.raises(WorkerLost, match=r"^worker llm/0 exited with code -9\nthen encoder/0 failed: ConnectionError"):
        driver._check_alive()


def test_a_silent_worker_is_blamed_before_a_reporter():
    driver = _driver(_Launcher(), [_error(("encoder", 0))], silent={("llm", 1)})
    with pytest.raises(WorkerLost, match=r"^worker llm/1 silent for more than router.worker_timeout_s=60.0\nthen encoder/0"):
        driver._collect("step", lambda result: True)


def test_a_failure_that_would_repeat_ends_the_run_whoever_else_is_lost():
    oom = "Traceback...\ntorch.OutOfMemoryError: CUDA out of memory."
    driver = _driver(_Launcher([(("llm", 0), "exited with code -9")]), [_error(("llm", 1), oom, repeats=True)])
    with pytest.raises(RunAborted, match="^worker llm/1 ran out of GPU memory"):
        driver._collect("step", lambda result: True)
