"""Where a start's time goes: a worker logs its start-up phases in one line, and the router
times each phase of a new generation (reported in resize notices and its log)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dyad import startup
from dyad.router.driver import GenerationStart


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process's age is read from Linux's /proc")
def test_process_age_counts_from_the_process_start():
    code = "import time; time.sleep(0.5); from dyad.startup import process_age_s; print(process_age_s())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 30.0


def test_the_summary_names_each_phase_in_order_and_their_total(monkeypatch):
    clock = iter([10.0, 10.5, 13.0])
    monkeypatch.setattr(startup.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(startup, "process_age_s", lambda: 4.0)
    timeline = startup.StartupTimeline()
    timeline.done("registration")
    timeline.done("model and optimizer")
    assert timeline.summary() == (
        "started in 7.0 s (interpreter and imports 4.0 s, registration 0.5 s, model and optimizer 2.5 s)"
    )


def test_without_the_process_age_the_summary_counts_only_the_phases(monkeypatch):
    clock = iter([1.0, 2.0])
    monkeypatch.setattr(startup.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(startup, "process_age_s", lambda: None)
    timeline = startup.StartupTimeline()
    timeline.done("registration")
    assert timeline.summary() == "started in 1.0 s (registration 1.0 s)"


def test_a_generation_start_adds_up_its_phases():
    timing = GenerationStart(stopping_s=1.3, registering_s=15.0, setting_up_s=20.6)
    assert timing.total_s == pytest.approx(36.9)
    assert str(timing) == (
        "36.9s (stopping 1.3 s, starting and registering 15.0 s, setting up and restoring 20.6 s)"
    )

