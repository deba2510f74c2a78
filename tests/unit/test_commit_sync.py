"""Who syncs a checkpoint's files (`RunDriver._commit`): the router's commit thread, while
training goes on, for periodic and on-demand checkpoints; the workers as they write for those
the run waits for (before a resize, at the end) and for every one with
`checkpoint.sync_in_background=false`. The driver runs here without workers: the save commands
it sends are recorded and each pool's part is a written directory."""

from __future__ import annotations

import json

import pytest

from dyad.data import make_dataset
from dyad.router.checkpoints import Committed, checkpoint_dir
from dyad.router.driver import GenerationStart, RunDriver, WorkerLost
from dyad.router.run import Run
from dyad.router.sampler import Cursor
from dyad.wire import pb
from tests.helpers.launchers import NoWorkers
from tests.helpers.resilience import job_config, records_of


def _driver(tmp_path, *overrides):
    config = job_config(tmp_path, *overrides)
    run = Run("r", config)
    driver = RunDriver(run, launcher=None, router_address="", dataset=make_dataset(config.data))
    saves = []

    def send(command, pools=None):
        if command.HasField("save"):
            saves.append(command.save)
            for pool in ("encoder", "llm"):
                (tmp_path / "checkpoints" / f"step_{command.save.step:08d}" / pool).mkdir(parents=True)

    run.send = send
    driver._collect = lambda kind, matches: {}
    driver._start_generation = lambda restarting, restore_all: GenerationStart(0.0, 0.0, 0.0)
    driver._metrics_file = records_of(driver.run, tmp_path)
    return driver, run, saves


@pytest.mark.parametrize("background", [True, False])
def test_the_workers_sync_what_the_run_waits_for_and_the_commit_thread_the_rest(tmp_path, background):
    driver, run, saves = _driver(tmp_path, f"checkpoint.sync_in_background={str(background).lower()}")
    driver.step = 2
    run.checkpoint_requested.set()
    driver._between_steps()  # an on-demand checkpoint
    driver.step = 3
    run.request_scale(pb.POOL_ENCODER, 2)
    driver._between_steps()  # a resize
    driver.step = 4
    driver._commit(wait=True)  # as at the end of the run
    driver.commits.close()
    driver._metrics_file.close()
    assert [(save.step, save.sync_files) for save in saves] == [(2, not background), (3, True), (4, True)]
    assert driver.committed.step == 4 and (tmp_path / "checkpoints" / "step_00000002" / "manifest.json").exists()
    assert run.pool_sizes["encoder"] == 2


class _SyncingAtTheFailure:
    """The commit thread with step 4's checkpoint still syncing: `wait` records when it is
    called and returns it committed."""

    def __init__(self, tmp_path, events: list[str]):
        self.events = events
        self.syncing = Committed(checkpoint_dir(tmp_path, 4), 4, Cursor(), {})

    def finished(self):
        return None

    def wait(self):
        self.events.append("commit waited for")
        syncing, self.syncing = self.syncing, None
        return syncing


def test_a_recovery_restarts_the_workers_while_the_last_checkpoint_syncs_then_restores_it(tmp_path):
    """A worker dies while step 4's checkpoint syncs in the background: the workers are stopped
    and started at once, the commit is waited for only before their setup, and the setup
    restores step 4 (not step 2, the last one committed when the failure came)."""
    events: list[str] = []

    class _Records(NoWorkers):
        def stop(self, pools=None, timeout_s=10.0):
            events.append("workers stopped")

        def start(self, run_id, router_address, workers, log_dir, env=None):
            events.append("workers started")

    config = job_config(tmp_path)
    run = Run("r", config)
    driver = RunDriver(run, launcher=_Records(), router_address="", dataset=make_dataset(config.data))
    driver.committed = Committed(checkpoint_dir(tmp_path, 2), 2, Cursor(), {})
    driver.step = 5
    driver.commits = _SyncingAtTheFailure(tmp_path, events)
    driver.written = driver.commits.syncing
    run.wait_for_workers = lambda timeout_s, check: True
    setups = []
    run.send = lambda command, pools=None: setups.append(command.setup) if command.HasField("setup") else None
    driver._collect = lambda kind, matches: {}
    with records_of(driver.run, tmp_path) as driver._metrics_file:
        driver._recover(WorkerLost("worker llm/1 exited with code -9"))
    assert events == ["workers stopped", "workers started", "commit waited for"]
    assert {setup.restore_path for setup in setups} == {str(checkpoint_dir(tmp_path, 4))}
    assert driver.step == 4 and run.info().last_checkpoint == str(checkpoint_dir(tmp_path, 4))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in records if "event" in r] == [("recovery", 4), ("checkpoint", 4)]
