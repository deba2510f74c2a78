"""Which checkpoint a run continues from: only committed ones (a manifest written last, once
every file of the parts is synced, recording each file's size and SHA-256), the newest whose
files still match; a bad `resume_from` is refused by name, and so is a bad file. Commits on the
router's commit thread come back in order, or with why they failed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

import pytest

from dyad.data import make_dataset
from dyad.router import checkpoints
from dyad.router.checkpoints import (
    MANIFEST,
    BackgroundCommits,
    Committed,
    CorruptCheckpoint,
    checkpoint_dir,
    commit,
    latest_committed,
    read_committed,
    resolve_resume,
    verify,
)
from dyad.router.driver import RunAborted, RunDriver, WorkerLost
from dyad.router.run import Run
from dyad.router.sampler import Cursor
from tests.helpers.launchers import NoWorkers
from tests.helpers.resilience import job_config, records_of


def _write(out_dir, step, *, committed=True):
    path = checkpoint_dir(out_dir, step)
    for pool in ("encoder", "llm"):
        (path / pool).mkdir(parents=True)
        (path / pool / "__0_0.distcp").write_bytes(f"{pool} tensors of step {step}".encode())
    if committed:
        commit(path, run_id="r", step=step, cursor=Cursor(1, step * 8), layouts={})
    return path


def test_the_newest_committed_checkpoint_wins_over_newer_incomplete_ones(tmp_path):
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    _write(tmp_path, 6, committed=False)
    (checkpoint_dir(tmp_path, 8) / "encoder").mkdir(parents=True)  # the LLM never wrote
    found = latest_committed(tmp_path)
    assert found.step == 4 and found.cursor == Cursor(1, 32)
    assert resolve_resume(str(tmp_path)).step == 4
    assert resolve_resume(str(checkpoint_dir(tmp_path, 2))).step == 2


def test_commit_needs_both_pools_and_refuses_incomplete_or_bad_paths(tmp_path):
    path = checkpoint_dir(tmp_path, 3)
    (path / "llm").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="encoder"):
        commit(path, run_id="r", step=3, cursor=Cursor(), layouts={})
    assert not (path / MANIFEST).exists()
    with pytest.raises(ValueError, match="no manifest.json"):
        read_committed(path)
    with pytest.raises(ValueError, match="checkpoint.resume_from"):
        resolve_resume(str(tmp_path / "nowhere"))
    (path / MANIFEST).write_text("{")
    with pytest.raises(ValueError, match="malformed"):
        read_committed(path)
    assert latest_committed(tmp_path) is None


def _write_parts(path):
    for pool in ("encoder", "llm"):
        (path / pool / "sub").mkdir(parents=True)
        (path / pool / "__0_0.distcp").write_bytes(b"tensor bytes")
        (path / pool / "sub" / ".metadata").write_bytes(b"metadata")


def test_every_file_and_directory_of_the_parts_is_synced_before_the_manifest_exists(tmp_path, monkeypatch):
    path = checkpoint_dir(tmp_path, 5)
    _write_parts(path)
    synced_before_manifest, real_fsync = [], os.fsync

    def recording_fsync(fd):
        if not (path / MANIFEST).exists():
            synced_before_manifest.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    commit(path, run_id="r", step=5, cursor=Cursor(0, 40), layouts={})
    everything = {str(p) for pool in ("encoder", "llm") for p in [path / pool, *(path / pool).rglob("*")]}
    assert everything - set(synced_before_manifest) == set()
    assert read_committed(path).step == 5


def test_the_manifest_records_the_size_and_sha256_of_every_file_of_the_parts(tmp_path):
    path = checkpoint_dir(tmp_path, 5)
    _write_parts(path)
    committed = commit(path, run_id="r", step=5, cursor=Cursor(0, 40), layouts={})
    files = {
        f"{pool}/{name}": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for pool in ("encoder", "llm")
        for name, data in (("__0_0.distcp", b"tensor bytes"), ("sub/.metadata", b"metadata"))
    }
    assert json.loads((path / MANIFEST).read_text())["files"] == files
    assert committed.files == read_committed(path).files == files
    verify(read_committed(path))


@pytest.mark.parametrize("damage, message", [
    ("missing", "No such file or directory"),
    ("truncated", "size 5 != 12 recorded"),
    ("flipped", "sha256 mismatch"),
])
def test_verify_names_the_file_that_is_missing_truncated_or_changed(tmp_path, damage, message):
    path = checkpoint_dir(tmp_path, 5)
    _write_parts(path)
    commit(path, run_id="r", step=5, cursor=Cursor(0, 40), layouts={})
    shard = path / "llm" / "__0_0.distcp"
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        os.truncate(shard, 5)
    else:  # the same size, one byte changed
        shard.write_bytes(b"tensor bytez")
    with pytest.raises(CorruptCheckpoint, match=f"^{shard}: .*{message}"):
        verify(read_committed(path))


def test_a_manifest_that_records_no_files_is_loaded_unverified(tmp_path):
    """Manifests written before they recorded their files have nothing to check the files
    against: they are taken as they are, not refused."""
    path = _write(tmp_path, 2)
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"]
    (path / MANIFEST).write_text(json.dumps(manifest))
    (path / "llm" / "__0_0.distcp").write_bytes(b"changed")
    assert read_committed(path).files is None
    verify(read_committed(path))
    assert latest_committed(tmp_path).step == 2
    (path / MANIFEST).write_text(json.dumps(manifest | {"files": {"llm/x": {"bytes": 1}}}))
    with pytest.raises(ValueError, match="malformed"):
        read_committed(path)


def test_a_checkpoint_whose_files_do_not_verify_is_passed_over_for_the_previous_one(tmp_path, caplog):
    for step in (2, 4, 6):
        _write(tmp_path, step)
    os.truncate(checkpoint_dir(tmp_path, 6) / "encoder" / "__0_0.distcp", 3)
    (checkpoint_dir(tmp_path, 4) / "llm" / "__0_0.distcp").write_bytes(b"llm tensors of step 5")
    with caplog.at_level(logging.WARNING, logger="dyad.router.checkpoints"):
        assert latest_committed(tmp_path).step == 2
    assert [record.getMessage() for record in caplog.records] == [
        f"passing over the checkpoint at step 6: {checkpoint_dir(tmp_path, 6)}/encoder/__0_0.distcp: size 3 != 25 recorded",
        (f"passing over the checkpoint at step 4: {checkpoint_dir(tmp_path, 4)}/llm/__0_0.distcp: sha256 mismatch "
         f"({hashlib.sha256(b'llm tensors of step 5').hexdigest()} != "
         f"{hashlib.sha256(b'llm tensors of step 4').hexdigest()} recorded)"),
    ]
    assert resolve_resume(str(tmp_path)).step == 2
    # A checkpoint directory named on its own is that checkpoint or none.
    with pytest.raises(ValueError, match=f"{checkpoint_dir(tmp_path, 6)}/encoder/__0_0.distcp: size 3"):
        resolve_resume(str(checkpoint_dir(tmp_path, 6)))
    (checkpoint_dir(tmp_path, 2) / "encoder" / "__0_0.distcp").unlink()
    assert latest_committed(tmp_path) is None
    with pytest.raises(ValueError, match="no checkpoint whose files verify: .*step_00000006.*step_00000004.*step_00000002"):
        resolve_resume(str(tmp_path))


def test_background_commits_come_back_once_synced_in_order_or_with_their_failure(tmp_path, monkeypatch):
    release, real_sync = threading.Event(), checkpoints.sync_tree
    monkeypatch.setattr(checkpoints, "sync_tree", lambda root: release.wait(30) and real_sync(root))
    commits = BackgroundCommits()
    path = checkpoint_dir(tmp_path, 2)
    _write_parts(path)
    commits.start(Committed(path, 2, Cursor(0, 16), {}), run_id="r")
    assert commits.finished() is None and not (path / MANIFEST).exists()  # still syncing
    with pytest.raises(RuntimeError, match="still being committed"):
        commits.start(Committed(path, 2, Cursor(0, 16), {}), run_id="r")
    release.set()
    assert commits.wait().step == 2 and read_committed(path).cursor == Cursor(0, 16)
    assert commits.finished() is None and commits.wait() is None  # given back once

    broken = checkpoint_dir(tmp_path, 4)
    (broken / "llm").mkdir(parents=True)  # the encoder's part is missing
    commits.start(Committed(broken, 4, Cursor(0, 32), {}), run_id="r")
    with pytest.raises(RuntimeError, match="encoder"):
        commits.wait()
    assert latest_committed(tmp_path).step == 2
    commits.close()


# ---------------------------------------------------------------- the driver's choice

def _recovering_driver(tmp_path, *overrides):
    """A driver without workers whose run committed checkpoints at steps 2 and 4 and is at step 5."""
    config = job_config(tmp_path, *overrides)
    run = Run("r", config)
    driver = RunDriver(run, launcher=NoWorkers(), router_address="", dataset=make_dataset(config.data))
    for step in (2, 4):
        _write(tmp_path, step)
    driver.committed = driver.written = read_committed(checkpoint_dir(tmp_path, 4))
    driver.step = 5
    run.wait_for_workers = lambda timeout_s, check: True
    setups = []
    run.send = lambda command, pools=None: setups.append(command.setup) if command.HasField("setup") else None
    driver._collect = lambda kind, matches: {}
    driver._metrics_file = records_of(driver.run, tmp_path)
    return driver, run, setups


def _records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def _events(tmp_path) -> list[tuple[str, int]]:
    return [(r["event"], r["step"]) for r in _records(tmp_path) if "event" in r]


def test_a_recovery_passes_over_a_checkpoint_that_does_not_verify_without_counting_it(tmp_path):
    driver, run, setups = _recovering_driver(tmp_path)
    shard = checkpoint_dir(tmp_path, 4) / "encoder" / "__0_0.distcp"
    os.truncate(shard, 1)
    driver._recover(WorkerLost("worker llm/0 exited with code -9"))
    driver._metrics_file.close()
    assert {setup.restore_path for setup in setups} == {str(checkpoint_dir(tmp_path, 2))}
    assert driver.step == 2 and run.info().recoveries == 1 and run.info().generation == 1
    assert _events(tmp_path) == [("recovery", 4), ("corrupt_checkpoint", 4)]
    skipped = _records(tmp_path)[-1]["message"]
    assert skipped == f"{shard}: size 1 != 25 recorded; passing over {checkpoint_dir(tmp_path, 4)}", skipped


def test_a_recovery_with_no_checkpoint_left_draws_the_initial_weights_in_one_more_generation(tmp_path):
    """A run started from its initial weights goes back to them when none of its checkpoints
    verifies: the workers started to restore one are started again to draw them."""
    driver, run, setups = _recovering_driver(tmp_path)
    for step in (2, 4):
        (checkpoint_dir(tmp_path, step) / "llm" / "__0_0.distcp").unlink()
    generations = []
    real_new_generation = run.new_generation
    run.new_generation = lambda *args, **kwargs: (generations.append(kwargs["restores"]),
                                                  real_new_generation(*args, **kwargs))[1]
    driver._recover(WorkerLost("worker llm/0 exited with code -9"))
    driver._metrics_file.close()
    assert generations == [True, False]
    assert [setup.restore_path for setup in setups] == ["", ""]  # the second generation's, to both pools
    assert driver.step == 0 and driver.committed is None and run.info().recoveries == 1
    assert _events(tmp_path) == [("recovery", 4), ("corrupt_checkpoint", 4), ("corrupt_checkpoint", 2)]


def test_a_resumed_run_whose_checkpoints_do_not_verify_fails_naming_the_file(tmp_path):
    source = tmp_path / "source"
    _write(source, 6)
    shard = checkpoint_dir(source, 6) / "llm" / "__0_0.distcp"
    shard.write_bytes(b"llm tensors of step 7")
    driver, _, _ = _recovering_driver(tmp_path / "run", f"checkpoint.resume_from={source}")
    with pytest.raises(RunAborted, match=f"no checkpoint to continue from verifies: {shard}: sha256 mismatch"):
        driver._first_checkpoint()
    driver._metrics_file.close()


def test_a_step_written_again_loses_its_old_manifest_before_the_pools_write(tmp_path):
    """A run that went back past step 4 writes step 4 again: until its new commit, the old
    manifest would describe files being overwritten."""
    driver, _, _ = _recovering_driver(tmp_path)
    driver.step = 4
    manifest_while_saving = []
    driver._collect = lambda kind, matches: manifest_while_saving.append(
        (checkpoint_dir(tmp_path, 4) / MANIFEST).exists()) or {}
    driver._commit(wait=True)
    driver._metrics_file.close()
    assert manifest_while_saving == [False]
    assert read_committed(checkpoint_dir(tmp_path, 4)).step == 4  # committed again


def test_pruning_keeps_the_newest_committed_checkpoints_and_deletes_the_older_ones(tmp_path):
    for step in (2, 4, 6, 8):
        _write(tmp_path, step)
    (checkpoint_dir(tmp_path, 3) / "llm").mkdir(parents=True)  # a crashed write, older than those kept
    (checkpoint_dir(tmp_path, 9) / "llm").mkdir(parents=True)  # one being written now
    root = tmp_path / "checkpoints"
    assert checkpoints.prune(root, 0) == []  # 0: keep all
    assert checkpoints.prune(root, 2) == [checkpoint_dir(tmp_path, s) for s in (2, 3, 4)]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000006", "step_00000008", "step_00000009"]
    assert [c.step for c in checkpoints.committed_in(tmp_path)] == [8, 6]
    assert checkpoints.prune(root, 2) == []


def test_a_background_commit_prunes_once_it_has_committed(tmp_path):
    _write(tmp_path, 2)
    _write(tmp_path, 4, committed=False)  # written by the pools, not yet committed
    written = checkpoints.Committed(checkpoint_dir(tmp_path, 4), 4, Cursor(1, 32), {})
    commits = checkpoints.BackgroundCommits()
    commits.start(written, run_id="r", keep_last=1)
    assert commits.wait().step == 4
    commits.close()
    assert [c.step for c in checkpoints.committed_in(tmp_path)] == [4]
    assert not checkpoint_dir(tmp_path, 2).exists()
