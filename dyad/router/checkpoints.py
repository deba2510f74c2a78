"""Committed checkpoints: a directory per step with each pool's DCP checkpoint, and a manifest
the router writes last and atomically, once every file of the pools' parts is on stable storage.
A directory without a manifest is incomplete (a pool died while writing, or the router did
before committing) and is never loaded.

    <out_dir>/checkpoints/step_00000120/{encoder/, llm/, manifest.json}
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dyad.pools import pool_names
from dyad.router.sampler import Cursor

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Committed:
    path: Path
    step: int
    cursor: Cursor  # the sampler's position after `step` steps
    layouts: dict  # the pools' layouts when it was written (informational: loading reshards)


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step:08d}"


def commit(path: Path, *, run_id: str, step: int, cursor: Cursor, layouts: dict) -> Committed:
    """Sync the pools' parts to stable storage, then write the manifest; atomic (rename)."""
    missing = [pool for pool in pool_names() if not (path / pool).is_dir()]
    if missing:
        raise RuntimeError(f"cannot commit {path}: no checkpoint from pool(s) {', '.join(missing)}")
    for pool in pool_names():
        sync_tree(path / pool)
    manifest = {
        "run_id": run_id,
        "step": step,
        "cursor": {"epoch": cursor.epoch, "offset": cursor.offset},
        "layouts": layouts,
    }
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    _fsync(path)  # the rename itself
    _fsync(path.parent)  # and the step's directory in checkpoints/
    return Committed(path, step, cursor, layouts)


def sync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory (their entries), `root` last. On one
    host fsync flushes a file whoever wrote it; on a shared filesystem see docs/deploy.md."""
    directories = []
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync(Path(directory) / name)
        directories.append(Path(directory))
    for directory in reversed(directories):
        _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BackgroundCommits:
    """Commits checkpoints on one thread, in order, while training goes on: `start` hands over a
    checkpoint every pool has written; `finished` and `wait` give it back once committed, or
    raise why it could not be (e.g. an fsync failed)."""

    def __init__(self):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit")
        self._pending: Future | None = None

    def start(self, written: Committed, run_id: str) -> None:
        if self._pending is not None:
            raise RuntimeError("a checkpoint is still being committed: wait() for it first")
        self._pending = self._thread.submit(
            commit, written.path, run_id=run_id, step=written.step, cursor=written.cursor,
            layouts=written.layouts,
        )

    def finished(self) -> Committed | None:
        """The pending checkpoint if it has been committed since the last call, else None."""
        if self._pending is None or not self._pending.done():
            return None
        return self.wait()

    def wait(self) -> Committed | None:
        """Block until the pending checkpoint is committed; it, or None if none was pending."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        """Stops the thread once a commit still running is done (the driver waits for it before)."""
        self._thread.shutdown()


def read_committed(path: str | Path) -> Committed:
    """The committed checkpoint at `path`; ValueError if it has no (valid) manifest."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        cursor = Cursor(int(manifest["cursor"]["epoch"]), int(manifest["cursor"]["offset"]))
        return Committed(path.resolve(), int(manifest["step"]), cursor, manifest.get("layouts", {}))
    except FileNotFoundError:
        raise ValueError(f"{path} is not a committed checkpoint (no {MANIFEST})") from None
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path / MANIFEST} is malformed: {error!r}") from None


def latest_committed(out_dir: str | Path) -> Committed | None:
    """The newest committed checkpoint of a run's out_dir; incomplete ones are skipped."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return None
    for candidate in sorted(root.glob("step_*"), reverse=True):
        try:
            return read_committed(candidate)
        except ValueError:
            continue
    return None


def resolve_resume(resume_from: str) -> Committed:
    """`checkpoint.resume_from`: a committed checkpoint directory or a run's out_dir."""
    path = Path(resume_from)
    if (path / MANIFEST).exists():
        return read_committed(path)
    found = latest_committed(path)
    if found is None:
        raise ValueError(
            f"checkpoint.resume_from ({resume_from}) holds no committed checkpoint "
            f"(a checkpoint directory with {MANIFEST}, or a run directory with checkpoints/)"
        )
    return found
