"""How long the router waits for the workers it stops to exit before it terminates them: a
recovery's workers were mid-step when a peer died, and one waiting for that peer may never return
(on two H200s a survivor sat out the whole 10 s), so the recovery waits only
`router.abort_grace_s`; a resize stops workers between steps and waits `router.stop_grace_s`.
The driver runs here without workers; its launcher records each stop and ends the restart."""

from __future__ import annotations

import pytest

from dyad import config as config_lib
from dyad.data import make_dataset
from dyad.layout import POOLS
from dyad.router.driver import RunDriver, WorkerLost
from dyad.router.run import Run
from dyad.wire import pb
from tests.resilience import job_config
from tests.test_router import NoWorkers


class _Stopped(Exception):
    """Raised by the launcher once it has recorded a stop: the restart goes no further."""


class _RecordsStops(NoWorkers):
    def __init__(self):
        self.stops: list[tuple[tuple[str, ...], float]] = []

    def stop(self, pools=None, timeout_s=10.0):
        self.stops.append((tuple(pools), timeout_s))
        raise _Stopped


def _driver(tmp_path) -> tuple[RunDriver, Run, _RecordsStops]:
    config = job_config(tmp_path, "router.stop_grace_s=7", "router.abort_grace_s=0.5")
    run = Run("r", config)
    launcher = _RecordsStops()
    driver = RunDriver(run, launcher=launcher, router_address="", dataset=make_dataset(config.data))
    driver._metrics_file = open(tmp_path / "metrics.jsonl", "a")  # noqa: SIM115 - closed by the test
    return driver, run, launcher


def test_a_recovery_stops_its_workers_with_the_abort_grace(tmp_path):
    driver, _, launcher = _driver(tmp_path)
    with pytest.raises(_Stopped):
        driver._recover(WorkerLost("worker llm/1 exited with code -9"))
    driver._metrics_file.close()
    assert launcher.stops == [(POOLS, 0.5)]


def test_a_resize_stops_its_workers_with_the_stop_grace(tmp_path):
    driver, run, launcher = _driver(tmp_path)
    driver._collect = lambda kind, matches: {}
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    for pool in POOLS:  # the pools' parts of the checkpoint the resize commits first
        (tmp_path / "checkpoints" / "step_00000002" / pool).mkdir()
    driver.step = 2
    run.request_scale(pb.POOL_ENCODER, 2)
    with pytest.raises(_Stopped):
        driver._between_steps()
    driver.commits.close()
    driver._metrics_file.close()
    assert launcher.stops == [(("encoder",), 7.0)]


def test_the_abort_grace_is_checked_like_the_others():
    with pytest.raises(ValueError, match=r"router.abort_grace_s must be > 0, got 0"):
        config_lib.load(None, ["router.abort_grace_s=0"])
