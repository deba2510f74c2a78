"""A router that takes a run over from one that died: the dead router may have sent its last
commands to only some workers, and a worker that has one (a step) may be waiting for a peer that
has not. The new router knows the last commands sent (persisted before any worker could have
them), and sends each worker that registers again the ones it never received, before the setup
that restores the checkpoint in place; a worker still busy with such a command keeps beating."""

from __future__ import annotations

import threading

from dyad.data import make_dataset
from dyad.router.checkpoints import Committed
from dyad.router.driver import RunDriver
from dyad.router.run import Run
from dyad.router.sampler import Cursor
from dyad.router.store import SqliteStore
from dyad.wire import pb
from tests.helpers.launchers import NoWorkers
from tests.helpers.resilience import job_config, records_of

ENCODER0 = pb.WorkerId(pool=pb.POOL_ENCODER, rank=0)
LLM0 = pb.WorkerId(pool=pb.POOL_LLM, rank=0)


def _sent_and_restored(tmp_path) -> tuple[Run, list[pb.WorkerCommand]]:
    """A run that sent ten commands before its router died (the last: an update and the next
    step), and the run as the next router reads it back from the store."""
    store = SqliteStore(tmp_path / "state.db")
    run = Run("r", job_config(tmp_path / "run"), store)
    run.new_generation(["encoder", "llm"], {"encoder": "h:1", "llm": "h:2"})
    sent = []
    for step in range(5):
        for command in (pb.WorkerCommand(step=pb.StepCommand(step=step)),
                        pb.WorkerCommand(apply=pb.ApplyCommand(step=step))):
            run.send(command)
            sent.append(command)
    run.send(pb.WorkerCommand(setup=pb.SetupCommand(generation=1)), ["llm"])
    [record] = store.runs()
    return Run.restored(record, store), sent


def test_commands_are_numbered_and_the_last_ones_survive_the_router(tmp_path):
    restored, sent = _sent_and_restored(tmp_path)
    assert [command.seq for command in sent] == list(range(1, 11))
    assert restored.commands_sent == 11
    assert [seq for seq, _, _ in restored.recent_commands] == list(range(4, 12))  # the last 8
    assert restored.recent_commands[-1][1] == ("llm",)
    assert restored.recent_commands[0][2] == sent[3]


def test_a_worker_registering_again_is_owed_only_what_it_missed_of_its_pools_commands(tmp_path):
    restored, sent = _sent_and_restored(tmp_path)
    restored.register(ENCODER0, "127.0.0.1:1", pid=1, generation=1, last_command=8)
    restored.register(LLM0, "127.0.0.1:2", pid=2, generation=1, last_command=10)
    assert restored.missed_by(("encoder", 0)) == sent[8:10]  # not the LLM pool's setup
    assert [command.seq for command in restored.missed_by(("llm", 0))] == [11]


def test_a_process_not_yet_registered_with_the_new_router_keeps_beating(tmp_path):
    """It is finishing a command of the dead router; a process of a re-formed pool still stops."""
    restored, _ = _sent_and_restored(tmp_path)
    assert restored.heartbeat(LLM0, b"", generation=1) == (False, 0.0)
    restored.new_generation(["llm"], {"llm": "h:3"})
    assert restored.heartbeat(LLM0, b"", generation=1)[0] is True


def test_the_new_router_sends_each_worker_what_it_missed_before_the_setup(tmp_path):
    restored, sent = _sent_and_restored(tmp_path)
    driver = RunDriver(restored, NoWorkers(), "", make_dataset(restored.config.data), resumed=True)
    driver._collect = lambda kind, matches: {}  # no workers answer here: the setup is not awaited
    driver.committed = Committed(tmp_path / "checkpoints" / "step_00000004", 4, Cursor(), {})  # restored in place
    driver._metrics_file = records_of(driver.run, tmp_path)
    took_over = threading.Thread(target=driver._take_over_workers)
    took_over.start()
    try:
        _wait_for_generation(restored, 2)  # the takeover's generation: workers may register
        restored.register(ENCODER0, "127.0.0.1:1", pid=1, generation=1, last_command=9)
        restored.register(LLM0, "127.0.0.1:2", pid=2, generation=1, last_command=11)
    finally:
        took_over.join(60)
    driver._metrics_file.close()
    queued = {key: _drained(channel.commands) for key, channel in restored.registered().items()}
    assert queued[("encoder", 0)][:1] == [sent[9]]  # the update it never received, then the setup
    assert [c.WhichOneof("command") for c in queued[("encoder", 0)]] == ["apply", "setup"]
    assert [c.WhichOneof("command") for c in queued[("llm", 0)]] == ["setup"]


def _wait_for_generation(run: Run, generation: int) -> None:
    with run._lock:
        assert run._lock.wait_for(lambda: run._info.generation >= generation, timeout=60)


def _drained(commands) -> list[pb.WorkerCommand]:
    found = []
    while not commands.empty():
        found.append(commands.get_nowait())
    return found


class _RecordsStarts(NoWorkers):
    def __init__(self):
        self.started, self.stopped = [], []

    def start(self, run_id, router_address, workers, log_dir, env=None):
        self.started.extend(workers)

    def stop(self, pools=None, timeout_s=10.0):
        self.stopped.append(tuple(pools) if pools is not None else None)


def test_a_router_taking_over_a_run_with_no_committed_checkpoint_starts_the_pools_again(tmp_path):
    """Restoring in place would keep weights trained past the step the run goes back to (0)."""
    restored, _ = _sent_and_restored(tmp_path)
    launcher = _RecordsStarts()
    driver = RunDriver(restored, launcher, "", make_dataset(restored.config.data), resumed=True)
    driver._collect = lambda kind, matches: {}
    restored.wait_for_workers = lambda timeout_s, check: True
    driver._metrics_file = records_of(driver.run, tmp_path)
    driver._continue_from(driver._first_checkpoint())
    driver._take_over_workers()
    driver._metrics_file.close()
    assert driver.committed is None and driver.step == 0
    assert launcher.stopped == [("encoder", "llm")]
    assert sorted((spec.pool, spec.rank) for spec in launcher.started) == [("encoder", 0), ("llm", 0)]
    assert [n.notice.kind for n in restored._events if n.HasField("notice")] == ["restart"]
