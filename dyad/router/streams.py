"""How many streams the router serves at once, and the threads that serve them."""

from __future__ import annotations

import contextlib
import threading

from dyad.router.errors import ResourceExhausted

# Client streams (WatchRun) a router serves at once, by default; more are refused with
# RESOURCE_EXHAUSTED.
MAX_WATCHERS = 256
# Threads for everything else: the workers' command streams (one each, for the run's life), their
# heartbeats and results, and clients' unary calls. Started on demand. Watchers have their own
# share on top, so no number of them can hold up a worker's call.
THREADS_BESIDES_WATCHERS = 1024


class StreamSlots:
    """A bounded number of concurrent streams: a slot is taken for a stream's life, or refused."""

    def __init__(self, limit: int, name: str):
        if limit < 1:
            raise ValueError(f"{name} must be >= 1, got {limit}")
        self.limit, self.name = limit, name
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._in_use

    @contextlib.contextmanager
    def slot(self):
        with self._lock:
            if self._in_use >= self.limit:
                raise ResourceExhausted(
                    f"the router serves at most {self.limit} WatchRun streams at once ({self.name}); "
                    "close one or try again later"
                )
            self._in_use += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_use -= 1
