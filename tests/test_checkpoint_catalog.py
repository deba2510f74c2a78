"""Which checkpoint a run continues from: only committed ones (a manifest written last), the
newest first; a bad `resume_from` is refused by name."""

from __future__ import annotations

import pytest

from dyad.router.checkpoints import (
    MANIFEST,
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
