"""What a followed run shows: that its workers are starting, then on a terminal a bar that starts
at the run's first reported step (a resumed run's), elsewhere a plain line every tenth of the run
or every 30 s, not a bar redrawn at every step."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys
import time

from dyad import config as config_lib
from dyad.app.jobs import Progress, run_job
from dyad.wire import pb


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Router:
    """A router whose run reports steps `first` .. `total - 1` and succeeds."""

    def __init__(self, total: int, first: int = 0):
        self.info = pb.RunInfo(run_id="r1", total_steps=total, state=pb.RUN_STATE_SUCCEEDED)
        self.first = first

    def start_run(self, config_yaml):
        return self.info

    def watch(self, run_id, from_step=0):
        for step in range(self.first, self.info.total_steps):
            yield pb.RunEvent(step=pb.StepMetrics(step=step, loss=1.0 / (step + 1), tokens_per_s=1000.0))
        yield pb.RunEvent(finished=self.info)

    def get_run(self, run_id):
        return self.info


def _followed(tmp_path, monkeypatch, router: _Router, stream) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    config = dataclasses.replace(config_lib.load(None, []), out_dir=str(tmp_path / "run"))
    job = run_job(config, router=router)
    assert len(job.metrics) == router.info.total_steps - router.first
    return stream.getvalue()


def test_a_log_gets_the_start_and_a_line_every_tenth_of_the_run(tmp_path, monkeypatch):
    shown = _followed(tmp_path, monkeypatch, _Router(800), io.StringIO())
    lines = shown.splitlines()
    assert lines[0] == "run r1: starting its workers (1 encoder + 1 llm)..."
    steps = [int(re.match(r"step (\d+)/800 \(\d+%\) loss [\d.]+ tokens/s 1000( \| |$)", line)[1]) for line in lines[1:]]
    assert steps == [1, 80, 160, 240, 320, 400, 480, 560, 640, 720, 800]
    assert "\r" not in shown and len(shown) < 2000  # the bar it replaces wrote 152 KB for 800 steps


def test_a_log_gets_a_line_when_every_s_passes_between_tenths(monkeypatch):
    stream, now = io.StringIO(), [0.0]
    monkeypatch.setattr("dyad.app.jobs.time.monotonic", lambda: now[0])
    progress = Progress(100, stream=stream, every_s=30.0)
    for step in range(6):
        now[0] = 20.0 * step  # 20 s a step: a line every other step, not every 10th
        progress.step({"step": step, "loss": 1.0, "tokens_per_s": 5.0})
    assert [line.split(" (")[0] for line in stream.getvalue().splitlines()] == [
        "step 1/100", "step 3/100", "step 5/100"
    ]
    assert stream.getvalue().splitlines()[-1].endswith("01:20 elapsed, 0.05 steps/s, ETA 31:40")


def test_a_resumed_run_starts_its_bar_at_the_resumed_step(tmp_path, monkeypatch):
    shown = _followed(tmp_path, monkeypatch, _Router(800, first=400), _Terminal())
    assert shown.startswith("run r1: starting its workers (1 encoder + 1 llm)...\n")
    assert not re.search(r"\b0/800\b", shown) and re.search(r"\b401/800\b", shown)  # from the resumed step on
    assert re.search(r"\b800/800\b", shown)


def test_the_rate_and_eta_count_only_the_steps_trained_since_the_resume():
    progress = Progress(800, stream=_Terminal())
    for step in (400, 401, 402):  # a step every 0.15 s or slower
        progress.step({"step": step, "loss": 1.0, "tokens_per_s": 5.0})
        time.sleep(0.15)
    bar = progress.bar.format_dict
    assert (bar["initial"], bar["n"]) == (401, 403)
    rate = bar["rate"] or (bar["n"] - bar["initial"]) / bar["elapsed"]
    assert rate < 10  # not 403 steps over half a second


def test_quiet_shows_nothing(tmp_path, monkeypatch):
    config = dataclasses.replace(config_lib.load(None, []), out_dir=str(tmp_path / "run"))
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    run_job(config, router=_Router(20), progress=False)
    assert stream.getvalue() == ""


def test_dyad_train_into_a_log_file_writes_lines_not_a_bar(tmp_path):
    """End to end, stderr a pipe: the start, then plain lines."""
    result = subprocess.run(
        [sys.executable, "-c", "from dyad.app.cli import main; main()", "train", "--out", str(tmp_path / "run"),
         "--device", "cpu", "--steps", "20", "--set", "checkpoint.interval_steps=0"],
        check=False, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert re.fullmatch(r"run \w+: starting its workers \(1 encoder \+ 1 llm\)\.\.\.", lines[0]), lines
    assert [line.split(" (")[0] for line in lines[1:-1]] == [f"step {n}/20" for n in (1, 2, 4, 6, 8, 10, 12, 14,
                                                                                      16, 18, 20)]
    # The run's evaluation at its end (eval.final), as a line of its own.
    assert re.fullmatch(r"step 20: held-out loss [\d.]+ over 359 samples, accuracy [\d.]+ on 359 \([\d.]+s\)",
                        lines[-1]), lines
    assert "\r" not in result.stderr
