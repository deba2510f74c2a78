"""Which checkpoint a run continues from: only committed ones (a manifest written last, once
every file of the parts is synced), the newest first; a bad `resume_from` is refused by name.
Commits on the router's commit thread come back in order, or with why they failed."""

from __future__ import annotations

import os
import threading

import pytest

from dyad.router import checkpoints
from dyad.router.checkpoints import (
    MANIFEST,
    BackgroundCommits,
    Committed,
    checkpoint_dir,
    commit,
    latest_committed,
    read_committed,
    resolve_resume,
)
from dyad.router.sampler import Cursor


def _write(out_dir, step, *, committed=True):
    path = checkpoint_dir(out_dir, step)
    for pool in ("encoder", "llm"):
        (path / pool).mkdir(parents=True)
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


def test_background_commits_come_back_once_synced_in_order_or_with_their_failure(tmp_path, monkeypatch):
    release, real_sync = threading.Event(), checkpoints.sync_tree
    monkeypatch.setattr(checkpoints, "sync_tree", lambda root: (release.wait(30), real_sync(root)))
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
