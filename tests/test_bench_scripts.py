"""Every benchmark script runs once at toy size on CPU, only to keep it working (the numbers
mean nothing here; docs/performance.md has the GPU ones)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize(
    "script,args",
    [
        ("moe_layer.py", ["--iters", "2"]),
        ("boundary_bandwidth.py", ["--iters", "2"]),
        ("llm_step.py", ["--iters", "2"]),
        ("e2e_hetero.py", []),
        ("ep_alltoall.py", ["--iters", "2"]),
        ("e2e_8gpu.py", []),
        ("resize.py", []),
        ("fp8_convergence.py", []),
        ("worker_threads.py", []),
    ],
)
def test_bench_script_runs_at_toy_size(tmp_path, script, args):
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--toy", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(out.read_text())["device"] == "cpu"
