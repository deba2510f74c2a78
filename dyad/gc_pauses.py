"""How long Python's garbage collector held a process. A collection stops every Python thread of
the worker, its kernel launches included, and a GPU whose launches stall idles; `GcPauses` times
each collection (through `gc.callbacks`) so that a step can say what the collector cost it."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Pauses:
    seconds: float = 0.0
    collections: int = 0
    oldest_generation: int = -1  # the oldest generation collected; -1 when none was


class GcPauses:
    def __init__(self):
        self._started: float | None = None
        self._pauses = Pauses()
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed during a collection
            return
        so_far = self._pauses
        self._pauses = Pauses(
            so_far.seconds + time.perf_counter() - self._started,
            so_far.collections + 1,
            max(so_far.oldest_generation, info["generation"]),
        )
        self._started = None

    def take(self) -> Pauses:
        """The pauses since the last `take` (or since this was built)."""
        pauses, self._pauses = self._pauses, Pauses()
        return pauses

    def close(self) -> None:
        gc.callbacks.remove(self._callback)
