"""A run whose out_dir fills up ends at once, FAILED and without a recovery (a restart would
write the same files), naming the file or checkpoint that did not fit; metrics.jsonl keeps whole
JSON lines; and `dyad train` exits with the run's failure, a plot it cannot write only a warning.
The full disk is `tests.helpers.full_disk`: this process's writes for the in-process router,
and a sitecustomize for the processes `dyad train` starts (its router and workers)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from dyad.wire import pb
from tests.helpers.full_disk import environment, fill_up
from tests.helpers.resilience import in_process_router, job_config, run_followed

REPO = Path(__file__).resolve().parents[2]


def _records(path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n"), text[-300:]
    return [json.loads(line) for line in text.splitlines()]


def test_a_full_disk_under_the_routers_metrics_ends_the_run_naming_the_file(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    fill_up({metrics: 1500}, monkeypatch)  # two or three steps' records
    with in_process_router() as (client, _):
        run = run_followed(client, job_config(tmp_path))
    assert run.info.state == pb.RUN_STATE_FAILED and run.info.recoveries == 0, run.info.message
    assert run.info.message.startswith(f"out of disk space writing {metrics} (No space left on device: "), run.info.message
    assert "so the run ends without recovering" in run.info.message
    records = _records(metrics)
    assert [r["step"] for r in records if "loss" in r] == list(range(len(records)))
    assert 0 < len(records) < 8


def _dyad_train(out, env):
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env["PYTHONPATH"]])  # this checkout's dyad
    return subprocess.run(
        [sys.executable, "-c", "from dyad.app.cli import main; main()", "train", "--out", str(out), "--quiet",
         "--device", "cpu", "--set", "train.steps=6", "--set", "train.warmup_steps=2",
         "--set", "train.global_batch=8", "--set", "checkpoint.interval_steps=2"],
        cwd=out.parent, capture_output=True, text=True, timeout=600, env=env, check=False,
    )


def test_dyad_train_ends_on_a_full_disk_under_a_checkpoint_with_the_runs_failure(tmp_path):
    """The checkpoint at step 4 does not fit (the one at step 2 did), nor does the plot."""
    out = tmp_path / "run"
    full = out / "checkpoints" / "step_00000004"
    result = _dyad_train(out, environment({full: 0, out / "loss.png": 0}))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    router_log = (out / "logs" / "router.log").read_text()
    assert f"could not plot the losses to {out / 'loss.png'}: OSError: [Errno 28]" in router_log, router_log[-3000:]
    failed = re.search(r"did not succeed: (.*)", result.stderr)
    assert failed, result.stderr[-3000:]
    assert re.match(
        rf"worker (encoder|llm)/0 ran out of disk space in its save writing {re.escape(str(full))}/(encoder|llm); "
        r"a restart from the checkpoint would too, so the run ends without recovering", failed.group(1),
    ), failed.group(1)
    records = _records(out / "metrics.jsonl")
    assert not [r for r in records if r.get("event") == "recovery"], records
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [2]  # committed, and kept
    assert (out / "checkpoints" / "step_00000002" / "manifest.json").is_file()
    assert not os.path.exists(full / "manifest.json")
