"""Committed checkpoints: a directory per step with each pool's DCP checkpoint, and a manifest
the router writes last and atomically, once every file of the pools' parts is on stable storage.
The manifest records each of those files' size and SHA-256, read as the file is synced, and a
checkpoint is loaded only once its files still match them (`verify`). A directory without a
manifest is incomplete (a pool died while writing, or the router did before committing) and is
never loaded; one whose files do not verify is passed over for the previous committed one.

    <out_dir>/checkpoints/step_00000120/{encoder/, llm/, manifest.json}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dyad.pools import pool_names
from dyad.router.sampler import Cursor

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Files read (hashed, synced) at a time: SHA-256 releases the GIL, so threads hash in parallel
# (about 1 GB/s a core with the CPU's SHA instructions; docs/resilience.md).
DIGEST_THREADS = 8


class CorruptCheckpoint(ValueError):
    """A committed checkpoint's file is missing, unreadable, or not what its manifest recorded."""


@dataclass(frozen=True)
class Committed:
    path: Path
    step: int
    cursor: Cursor  # the sampler's position after `step` steps
    layouts: dict  # the pools' layouts when it was written (informational: loading reshards)
    # Path relative to `path` -> {"bytes": size, "sha256": hex digest}, for every file of the
    # pools' parts; None where none were recorded (written, not yet committed; or a manifest
    # from before they were recorded).
    files: dict | None = None


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step:08d}"


def commit(path: Path, *, run_id: str, step: int, cursor: Cursor, layouts: dict) -> Committed:
    """Sync the pools' parts to stable storage, then write the manifest, with each of their
    files' size and SHA-256 (read as it is synced); atomic (rename)."""
    missing = [pool for pool in pool_names() if not (path / pool).is_dir()]
    if missing:
        raise RuntimeError(f"cannot commit {path}: no checkpoint from pool(s) {', '.join(missing)}")
    files = {
        f"{pool}/{name}": record for pool in pool_names() for name, record in sync_tree(path / pool).items()
    }
    manifest = {
        "run_id": run_id,
        "step": step,
        "cursor": {"epoch": cursor.epoch, "offset": cursor.offset},
        "layouts": layouts,
        "files": files,
    }
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    _fsync(path)  # the rename itself
    _fsync(path.parent)  # and the step's directory in checkpoints/
    return Committed(path, step, cursor, layouts, files)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete the step directories of `root` (a run's checkpoints/) older than its newest `keep`
    committed ones (0: none), incomplete ones among them; returns them. Each loses its manifest
    first, so that a deletion cut short never leaves a directory that reads as committed."""
    steps = sorted(root.glob("step_*"))
    committed = [path for path in steps if (path / MANIFEST).exists()]
    if keep == 0 or len(committed) <= keep:
        return []
    oldest_kept = committed[-keep]
    pruned = [path for path in steps if path < oldest_kept]
    for path in pruned:
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path)
        log.info("deleted %s (checkpoint.keep_last=%d)", path, keep)
    return pruned


def sync_tree(root: Path) -> dict[str, dict]:
    """fsync every file under `root`, then every directory (their entries), `root` last; returns
    each file's size and SHA-256 by its path relative to `root`, read in the same pass (files on
    `DIGEST_THREADS` threads). On one host fsync flushes a file whoever wrote it; on a shared
    filesystem see docs/deploy.md."""
    paths, directories = [], []
    for directory, _, names in os.walk(root):
        paths += [Path(directory) / name for name in names]
        directories.append(Path(directory))
    with ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="digest") as threads:
        records = dict(zip(paths, threads.map(_digest_and_sync, paths)))
    for directory in reversed(directories):
        _fsync(directory)
    return {path.relative_to(root).as_posix(): records[path] for path in sorted(paths)}


def _digest_and_sync(path: Path) -> dict:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        size = f.tell()
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": digest}


def _sha256(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as error:
        raise CorruptCheckpoint(f"{path}: {error.strerror or error}") from None


def verify(committed: Committed) -> None:
    """Check that every file the manifest recorded is there with its size and then (all sizes
    being right, so a truncated file costs no hashing) its SHA-256; CorruptCheckpoint naming the
    first bad file otherwise. A manifest that recorded no files (written before manifests did) is
    taken as it is: there is nothing to check its files against, and refusing it would strand
    every run that has only such checkpoints."""
    if committed.files is None:
        log.info("%s records no file sizes or digests (an older manifest): loaded unverified", committed.path)
        return
    for name, record in committed.files.items():
        path = committed.path / name
        try:
            size = path.stat().st_size
        except OSError as error:
            raise CorruptCheckpoint(f"{path}: {error.strerror or error} (recorded in {committed.path / MANIFEST})") from None
        if size != record["bytes"]:
            raise CorruptCheckpoint(f"{path}: size {size} != {record['bytes']} recorded")
    names = list(committed.files)
    threads = ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="verify")
    try:
        for name, digest in zip(names, threads.map(_sha256, [committed.path / name for name in names])):
            if digest != committed.files[name]["sha256"]:
                raise CorruptCheckpoint(
                    f"{committed.path / name}: sha256 mismatch ({digest} != {committed.files[name]['sha256']} recorded)"
                )
    finally:
        threads.shutdown(cancel_futures=True)  # the first bad file settles it


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

    def start(self, written: Committed, run_id: str, keep_last: int = 0) -> None:
        """Commit `written`, then prune the checkpoints before the newest `keep_last`."""
        if self._pending is not None:
            raise RuntimeError("a checkpoint is still being committed: wait() for it first")

        def commit_and_prune() -> Committed:
            committed = commit(
                written.path, run_id=run_id, step=written.step, cursor=written.cursor,
                layouts=written.layouts,
            )
            prune(written.path.parent, keep_last)
            return committed

        self._pending = self._thread.submit(commit_and_prune)

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
    """The committed checkpoint at `path` as its manifest records it (its files unverified:
    `verify`); ValueError if it has no (valid) manifest."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        cursor = Cursor(int(manifest["cursor"]["epoch"]), int(manifest["cursor"]["offset"]))
        files = manifest.get("files")
        if files is not None:
            files = {str(name): {"bytes": int(r["bytes"]), "sha256": str(r["sha256"])} for name, r in files.items()}
        return Committed(path.resolve(), int(manifest["step"]), cursor, manifest.get("layouts", {}), files)
    except FileNotFoundError:
        raise ValueError(f"{path} is not a committed checkpoint (no {MANIFEST})") from None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{path / MANIFEST} is malformed: {error!r}") from None


def committed_in(out_dir: str | Path) -> list[Committed]:
    """A run's committed checkpoints, newest first, as their manifests record them (unverified);
    directories without a (valid) manifest are left out."""
    root = Path(out_dir) / "checkpoints"
    found = []
    for candidate in sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []:
        try:
            found.append(read_committed(candidate))
        except ValueError:
            continue
    return found


def first_verified(
    candidates: Iterable[Committed], passed_over: Callable[[Committed, CorruptCheckpoint], None] | None = None,
) -> Committed | None:
    """The first of `candidates` whose files verify. Each one that does not is logged as a
    warning naming the bad file and handed, as its CorruptCheckpoint, to `passed_over(committed,
    error)` if given."""
    for candidate in candidates:
        try:
            verify(candidate)
            return candidate
        except CorruptCheckpoint as error:
            log.warning("passing over the checkpoint at step %d: %s", candidate.step, error)
            if passed_over is not None:
                passed_over(candidate, error)
    return None


def latest_committed(out_dir: str | Path) -> Committed | None:
    """The newest committed checkpoint of a run's out_dir whose files verify; incomplete ones
    are skipped, and so (with a warning naming the bad file) are ones that do not verify."""
    return first_verified(committed_in(out_dir))


def resume_candidates(resume_from: str, named: str = "checkpoint.resume_from") -> list[Committed]:
    """What `checkpoint.resume_from` offers, newest first: the committed checkpoint directory it
    names (that one only), or a run out_dir's committed checkpoints; unverified."""
    path = Path(resume_from)
    if (path / MANIFEST).exists():
        return [read_committed(path)]
    found = committed_in(path)
    if not found:
        raise ValueError(
            f"{named} ({resume_from}) holds no committed checkpoint "
            f"(a checkpoint directory with {MANIFEST}, or a run directory with checkpoints/)"
        )
    return found


def resolve_resume(resume_from: str, named: str = "checkpoint.resume_from") -> Committed:
    """`checkpoint.resume_from`: the committed checkpoint directory it names, or a run out_dir's
    newest committed checkpoint whose files verify (older ones stand in for those that do not);
    ValueError naming the bad file when none does."""
    candidates = resume_candidates(resume_from, named)
    bad = []
    found = first_verified(candidates, lambda committed, error: bad.append(str(error)))
    if found is None:
        raise ValueError(f"{named} ({resume_from}) holds no checkpoint whose files verify: {'; '.join(bad)}")
    return found
