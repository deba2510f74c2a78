"""Launchers for a router that runs without workers."""

from __future__ import annotations

import threading

from dyad.router.launcher import Launcher, WorkerSpec


class NoWorkers(Launcher):
    """Starts nothing: runs stay in STARTING until stopped."""

    def rendezvous(self, pools):
        return {pool: "127.0.0.1:1" for pool in pools}

    def start(self, run_id, router_address, workers, log_dir, env=None):
        pass

    def dead(self):
        return []

    def stop(self, pools=None, timeout_s=10.0):
        pass


class LostOnRequest(NoWorkers):
    """Starts nothing; once `lost` is set, says the workers it was asked to start, but those of
    `elsewhere` (a pod's, started by the test), are gone: the router recovers when the test says
    so, not when a deadline passes."""

    def __init__(self, lost: threading.Event, elsewhere: set[tuple[str, int]]):
        self.lost, self.elsewhere, self.asked = lost, elsewhere, []

    def start(self, run_id, router_address, workers, log_dir, env=None):
        self.asked = [spec for spec in workers if (spec.pool, spec.rank) not in self.elsewhere]

    def dead(self) -> list[tuple[WorkerSpec, str]]:
        return [(spec, "never started") for spec in self.asked] if self.lost.is_set() else []
