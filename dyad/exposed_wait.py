"""How long a worker's device sat idle because the worker waited for boundary data.

A worker that never syncs with its GPU runs ahead of it: it reaches the wait for the next
microbatch's rows (or gradients) while the GPU still runs the previous one, so the host's waiting
time says nothing about what the wait cost. On a CUDA device the cost is read from the GPU's own
clock: an event recorded as the wait begins completes once the GPU has run everything queued
before it; another recorded as the wait ends completes at once if the GPU had nothing else to
do. The time between the two is the time the GPU was idle for this wait (0 when the GPU was still
busy when the data came). On a CPU device the host does the computing, so its waiting time is the
cost.
"""

from __future__ import annotations

import contextlib
import time

import torch


class ExposedWait:
    """Per step: `with wait.measuring(): <wait for data>` around each wait, `seconds()` or
    `each_seconds()` once the step's work has been waited for (they read the events: a host sync
    on CUDA)."""

    def __init__(self, device: torch.device | str):
        self.on_gpu = torch.device(device).type == "cuda"
        self.host_s: list[float] = []  # each wait's host time, read on a CPU only
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def measuring(self):
        if not self.on_gpu:
            began = time.perf_counter()
            try:
                yield
            finally:
                self.host_s.append(time.perf_counter() - began)
            return
        before = _recorded_event()
        try:
            yield
        finally:
            self.marks.append((before, _recorded_event()))

    def seconds(self) -> float:
        """The device's idle time over every wait so far (the host's waiting time on a CPU)."""
        return sum(self.each_seconds())

    def each_seconds(self) -> list[float]:
        """The device's idle time in each wait so far, in the order waited (host time on a CPU)."""
        if not self.on_gpu:
            return list(self.host_s)
        if self.marks:
            self.marks[-1][1].synchronize()  # recorded last, so it completes last
        return [before.elapsed_time(after) / 1e3 for before, after in self.marks]


def _recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
