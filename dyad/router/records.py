"""A run's records in its out_dir (metrics.jsonl, samples.jsonl): JSON lines, each appended
whole or not at all, so that a reader never meets half a line, a full disk included."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Self


def json_line(record: dict) -> str:
    """`record` as one line of strict JSON: a NaN or infinite number (a diverged step's loss) is
    written as null, which every JSON reader reads."""
    return json.dumps(_finite(record), allow_nan=False) + "\n"


class NotWritten(OSError):
    """`size` bytes that could not be appended to `filename` (`errno` says why); the file is as
    it was before."""

    def __init__(self, error: OSError, path: Path, size: int):
        super().__init__(error.errno, error.strerror, str(path))
        self.size = size


class JsonLines:
    """An append-only file of JSON lines. Unbuffered: each `write` reaches the file whole, or
    the part that did is cut off again before NotWritten is raised."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - open until close()

    def write(self, lines: str) -> None:
        data = lines.encode()
        start = self._file.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view):]
        except OSError as error:
            self._file.truncate(start)
            raise NotWritten(error, self.path, len(data)) from error

    def flush(self) -> None:
        """Nothing is buffered here."""

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
