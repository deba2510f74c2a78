"""Launchers for a router that runs without workers."""

from __future__ import annotations

from dyad.router.launcher import Launcher


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
