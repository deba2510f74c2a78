"""The main job: `dyad train` with no config trains on digits and learns to read the image."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from dyad.router.launcher import _Adopted  # polls a process by pid, zombies as gone

REQUIRED = {"step", "loss", "lm_loss", "aux_loss", "tokens", "step_time_s", "tokens_per_s",
            "boundary_bytes_fwd", "boundary_bytes_bwd", "encoder_wait_s", "llm_wait_s", "llm_fill_wait_s",
            "encoder_peak_memory_gb", "llm_peak_memory_gb"}


def _dyad(*args, cwd):
    return subprocess.run(
        [sys.executable, "-c", "from dyad.app.cli import main; main()", *args],
        cwd=cwd, capture_output=True, text=True, timeout=900, env=dict(os.environ),
    )


def test_dyad_train_default_learns_digits(tmp_path):
    out = tmp_path / "run"
    result = _dyad("train", "--out", str(out), "--quiet", "--device", "cpu", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the local router exited with code" not in result.stderr, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    notices = [r for r in records if "event" in r]
    evaluations = [r for r in records if "eval_loss" in r]
    assert len(steps) == 800
    assert [n["step"] for n in notices] == [200, 400, 600, 800]  # committed checkpoints
    assert all(REQUIRED <= set(r) for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] / 10
    # Every eval.interval_steps (100) in the default config, the last at the end of the run.
    assert [r["step"] for r in evaluations] == list(range(100, 801, 100))
    final = evaluations[-1]
    assert final["eval_accuracy"] >= 0.9 and final["eval_answered"] == 359, final
    assert final["eval_loss"] < evaluations[0]["eval_loss"]
    assert re.search(r"held-out loss [\d.]+, caption_accuracy (0\.9\d\d|1\.000) on 359 held-out samples", result.stdout), result.stdout
    assert (out / "loss.png").stat().st_size > 0
    checkpoint = out / "checkpoints" / "step_00000800"
    assert json.loads((checkpoint / "manifest.json").read_text())["step"] == 800
    assert all((checkpoint / pool / ".metadata").is_file() for pool in ("encoder", "llm"))  # DCP
    for worker in ("encoder-0", "llm-0"):  # each says where its start went
        log = (out / "logs" / f"{worker}.log").read_text()
        assert re.search(r"generation 1: started in [\d.]+ s \(.*registration .*model and optimizer", log), log[-2000:]


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their command lines (Linux's /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found[int(entry.name)] = (entry / "cmdline").read_text().replace("\0", " ")
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found


def _workers(router: int) -> list[int]:
    """The router's workers: its children running the worker module, or on a machine without
    GPUs the children of its fork server (dyad/router/launcher.py)."""
    found = []
    for pid, command in _children(router).items():
        if "dyad.app.worker" in command:
            found.append(pid)
        elif "multiprocessing.forkserver" in command:
            found.extend(_children(pid))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's new parent may never reap it)."""
    return _Adopted(pid).poll() is None


def test_a_killed_dyad_train_takes_its_router_and_workers_with_it(tmp_path):
    """SIGKILL cannot be caught: the local router notices that `dyad train` is gone by the end of
    the pipe on its stdin, stops the run and exits, and its workers with it."""
    out = tmp_path / "run"
    cli = subprocess.Popen(
        [sys.executable, "-c", "from dyad.app.cli import main; main()", "train", "--out", str(out),
         "--quiet", "--device", "cpu", "--set", "train.steps=100000"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert cli.poll() is None and time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.2)
    routers = [pid for pid, command in _children(cli.pid).items() if "dyad.router" in command]
    assert len(routers) == 1, _children(cli.pid)
    workers = _workers(routers[0])
    assert len(workers) == 2, _children(routers[0])
    workers += list(_children(routers[0]))  # and the fork server they came from (CPU machines)

    cli.kill()
    cli.wait()
    deadline = time.monotonic() + 60
    try:
        while left := [pid for pid in [*routers, *workers] if _running(pid)]:
            assert time.monotonic() < deadline, f"still running 60 s after dyad train was killed: {left}"
            time.sleep(0.2)
    finally:  # a failure here must not leave them training for the rest of the suite
        for pid in [*routers, *workers]:
            if _running(pid):
                os.kill(pid, 9)
    assert "standard input closed" in (out / "logs" / "router.log").read_text()


def test_dyad_verify_prints_both_losses_and_passes(tmp_path):
    result = _dyad("verify", "--steps", "3", "--quiet", "--device", "cpu",
                   "--set", "train.global_batch=6", "--out", str(tmp_path / "v"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the local router exited with code" not in result.stderr, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "reference loss" in lines[0]
    assert len([l for l in lines if l.split() and l.split()[0].isdigit()]) == 3
    assert "largest parameter difference" in result.stdout and "PASS" in result.stdout


def test_dyad_verify_fails_a_layout_that_changes_the_math(tmp_path):
    """Capacity dropping applies to each rank's own tokens, so under cp=2 the LLM drops other
    tokens than one device does (README, "Status and limits"): a real difference verify must catch."""
    result = _dyad("verify", "--steps", "1", "--quiet", "--device", "cpu", "--set", "train.global_batch=6",
                   "--set", "parallel.llm.cp=2", "--set", "llm.moe.capacity_factor=0.5",
                   "--out", str(tmp_path / "v"), cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "FAIL: beyond tolerance 1e-05" in result.stderr
    assert "PASS" not in result.stdout


def test_bad_override_is_reported_with_its_field(tmp_path):
    result = _dyad("train", "--set", "train.lr=-1", "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert result.returncode == 2
    assert "train.lr" in result.stderr


def test_job_arguments_compose_file_overrides_steps_device_and_default_out(tmp_path, monkeypatch):
    """--config FILE, then each --set, then --steps and --device; without --out, runs/<timestamp>/."""
    from dyad.app.cli import _job_config, _parser

    config_file = tmp_path / "run.yaml"
    config_file.write_text("train:\n  lr: 2.0e-3\n  global_batch: 12\n  steps: 50\n")
    monkeypatch.chdir(tmp_path)
    args = _parser().parse_args(["train", "--config", str(config_file), "--set", "train.global_batch=6",
                                 "--set", "llm.moe.top_k=1", "--steps", "7", "--device", "cpu"])
    config = _job_config(args)
    assert config.train.lr == 2.0e-3  # from the file
    assert config.train.global_batch == 6 and config.llm.moe.top_k == 1  # --set wins over the file
    assert config.train.steps == 7 and config.train.device == "cpu"
    out = Path(config.out_dir)
    assert out.parent == tmp_path / "runs" and out.name[:8].isdigit()
