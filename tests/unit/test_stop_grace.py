"""How long the router waits for the workers it stops to exit before it terminates them: a
recovery's workers were mid-step when a peer died, and one waiting for that peer may never return
(on two H200s a survivor sat out the whole 10 s), so the recovery waits only
`router.abort_grace_s`; a resize stops workers between steps and waits `router.stop_grace_s`.
The driver runs here without workers; its launcher records each stop and ends the restart.
On Kubernetes the router cannot end a process: a stopped worker's heartbeats carry the generation
it joined, and the reply tells a process of a re-formed pool to end within that same grace."""

from __future__ import annotations

import pytest

from dyad import config as config_lib
from dyad.data import make_dataset
from dyad.pools import pool_names
from dyad.router.driver import RunDriver, WorkerLost
from dyad.router.run import Run
from dyad.wire import pb
from tests.helpers.launchers import NoWorkers
from tests.helpers.resilience import job_config, records_of


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
    driver._metrics_file = records_of(driver.run, tmp_path)
    return driver, run, launcher


def test_a_recovery_stops_its_workers_with_the_abort_grace(tmp_path):
    driver, _, launcher = _driver(tmp_path)
    with pytest.raises(_Stopped):
        driver._recover(WorkerLost("worker llm/1 exited with code -9"))
    driver._metrics_file.close()
    assert launcher.stops == [(pool_names(), 0.5)]


def test_a_resize_stops_its_workers_with_the_stop_grace(tmp_path):
    driver, run, launcher = _driver(tmp_path)
    driver._collect = lambda kind, matches: {}
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    for pool in pool_names():  # the pools' parts of the checkpoint the resize commits first
        (tmp_path / "checkpoints" / "step_00000002" / pool).mkdir()
    driver.step = 2
    run.request_scale(pb.POOL_ENCODER, 2)
    with pytest.raises(_Stopped):
        driver._between_steps()
    driver.commits.close()
    driver._metrics_file.close()
    assert launcher.stops == [(("encoder",), 7.0)]


def _joined(run: Run, rank: int = 0) -> tuple[pb.WorkerId, bytes, int]:
    """A process of llm rank `rank` registered into a first generation: (its id, the key it was
    issued, the generation)."""
    generation = run.new_generation(pool_names(), {pool: "127.0.0.1:1" for pool in pool_names()})
    worker = pb.WorkerId(pool=pb.POOL_LLM, rank=rank)
    key = run.register(worker, "127.0.0.1:2", pid=100).worker_key
    return worker, key, generation


def test_a_process_replaced_by_a_recovery_is_told_to_end_within_the_abort_grace(tmp_path):
    driver, run, _ = _driver(tmp_path)
    worker, key, joined = _joined(run)
    assert run.heartbeat(worker, key, joined) == (False, 0.0)
    with pytest.raises(_Stopped):
        driver._recover(WorkerLost("worker llm/1 exited with code -9"))
    driver._metrics_file.close()
    assert run.heartbeat(worker, key, joined) == (True, 0.5)
    # Its replacement registers into the new generation; the old process, still beating, is
    # still told to end and does not keep the replacement's channel alive.
    replacement = run.register(worker, "127.0.0.1:3", pid=101)
    new_key = replacement.worker_key
    run.channel(worker, new_key).last_seen = 0.0
    assert run.heartbeat(worker, key, joined) == (True, 0.5)
    assert run.channel(worker, new_key).last_seen == 0.0
    assert run.heartbeat(worker, new_key, replacement.generation) == (False, 0.0)
    assert run.channel(worker, new_key).last_seen > 0.0
    # A process that does not say its generation is judged by its pool's channels, as before.
    assert run.heartbeat(worker, new_key, 0) == (False, 0.0)


def test_a_process_replaced_by_a_resize_gets_the_stop_grace(tmp_path):
    """0 in the reply: the worker's own router.stop_grace_s."""
    _, run, _ = _driver(tmp_path)
    worker, key, joined = _joined(run)
    run.new_generation(["llm"], {"llm": "127.0.0.1:4"})
    assert run.heartbeat(worker, key, joined) == (True, 0.0)


def test_the_abort_grace_is_checked_like_the_others():
    with pytest.raises(ValueError, match=r"router.abort_grace_s must be > 0, got 0"):
        config_lib.load(None, ["router.abort_grace_s=0"])
