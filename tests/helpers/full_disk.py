"""A filesystem that fills up, for tests (a real tiny one needs root to mount): files opened
under chosen paths take that many bytes in all, then their writes fail with ENOSPC, as on a full
disk. A write that does not fit writes what does first: an unbuffered file returns the short
count and fails on its next write (what the kernel does); others raise at once.

In this process, `fill_up({path: bytes})` (undone by `monkeypatch`). In processes a test starts
(a local router, workers): `environment({path: bytes})` for their environment, which puts
`full_disk_site/` on PYTHONPATH, whose sitecustomize calls `fill_up` as the interpreter starts.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
from pathlib import Path

ENV = "DYAD_TEST_FULL_DISK"
SITE_DIR = Path(__file__).parent / "full_disk_site"


def environment(budgets: dict[str | Path, int], base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) for processes whose writes under `budgets`' paths fill up."""
    env = dict(os.environ if base is None else base)
    env[ENV] = json.dumps({str(path): size for path, size in budgets.items()})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE_DIR), env.get("PYTHONPATH")]))
    return env


def fill_up(budgets: dict[str | Path, int], monkeypatch=None) -> None:
    """From now on, files opened under each path have its bytes left between them."""
    left = {os.path.abspath(path): size for path, size in budgets.items()}
    real_open = io.open

    def opening(file, mode="r", *args, **kwargs):
        opened = real_open(file, mode, *args, **kwargs)
        if isinstance(file, int) or not any(ch in mode for ch in "wax+"):
            return opened
        path = os.path.abspath(os.fsdecode(file))  # str or bytes (TensorBoard's writer opens by bytes)
        under = [prefix for prefix in left if path == prefix or path.startswith(prefix + os.sep)]
        return _Filling(opened, left, under[0]) if under else opened

    for owner in (builtins, io):
        if monkeypatch is None:
            owner.open = opening
        else:
            monkeypatch.setattr(owner, "open", opening)


def from_environment() -> None:
    if os.environ.get(ENV):
        fill_up(json.loads(os.environ[ENV]))


class _Filling:
    def __init__(self, file, left: dict[str, int], prefix: str):
        self._file, self._left, self._prefix = file, left, prefix

    def write(self, data):
        size = len(data.encode() if isinstance(data, str) else memoryview(data).cast("B"))
        room = self._left[self._prefix]
        if size <= room:
            self._left[self._prefix] = room - size
            return self._file.write(data)
        self._left[self._prefix] = 0
        if room > 0:
            part = data[:room] if isinstance(data, str) else memoryview(data).cast("B")[:room]
            written = self._file.write(part)
            if isinstance(self._file, io.RawIOBase):
                return written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._file.close()

    def __iter__(self):
        return iter(self._file)
