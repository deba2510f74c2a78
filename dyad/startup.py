"""Where a worker's start goes: the process's age when its code begins (interpreter and imports),
then each phase until it can take commands, logged as one line. A restart of a pool is mostly
this and the restore (logged apart, `generation N: set up in ...`), so a user who sees a slow
resize or recovery can tell which part was slow.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_age_s() -> float | None:
    """Seconds since this process started, from Linux's /proc; None where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        after_name = stat.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
        started_ticks = int(after_name[19])  # field 22, starttime: clock ticks after boot
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupTimeline:
    """The seconds each start-up phase took, in order: `done(phase)` closes the phase that began
    when the last one ended (or when this was made)."""

    def __init__(self):
        age = process_age_s()
        self.phases: list[tuple[str, float]] = [] if age is None else [("interpreter and imports", age)]
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def summary(self) -> str:
        total = sum(seconds for _, seconds in self.phases)
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.phases)
        return f"started in {total:.1f} s ({parts})"
