"""Where a GPU step's wall time goes beside its kernels: the kernels of profiled steps in order,
with the idle gaps between them, from a torch.profiler trace.

`write_timeline(step, path, steps=3)` runs `step` under the profiler (each call inside a
"bench_step" range) and writes, per step: the wall time from the range's start to its last
kernel's end, the time the GPU ran kernels, the idle time before the first kernel (the host
launching the step's first work) and between kernels, then every kernel with its start offset,
duration and the gap before it. Used by `bench/moe_layer.py --timeline-dir`. `kernel_ms(step)`
is the median GPU time of the kernels a step launches (`bench/router_kernels.py`).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

STEP_RANGE = "bench_step"


def _trace_events(step, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            with record_function(STEP_RANGE):
                step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def _steps(events: list[dict]) -> list[tuple[float, float, list[dict]]]:
    """(range start, range end, kernels that start after it, by start time) per profiled step."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation")
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    bounds = [start for start, _ in ranges[1:]] + [float("inf")]
    return [(start, end, [k for k in kernels if start <= k["ts"] < bound])
            for (start, end), bound in zip(ranges, bounds)]


def step_lines(start: float, kernels: list[dict]) -> tuple[dict, list[str]]:
    """Summary numbers (µs) and one line per kernel of one step."""
    busy = idle = 0.0
    last_end = start
    lines = []
    for k in kernels:
        gap = max(0.0, k["ts"] - last_end)
        idle += gap
        busy += k["dur"]
        lines.append(f"{k['ts'] - start:10.1f} {k['dur']:9.1f} {gap:8.1f}  {k['name'][:110]}")
        last_end = max(last_end, k["ts"] + k["dur"])
    first_gap = kernels[0]["ts"] - start if kernels else 0.0
    summary = {"wall_us": last_end - start, "kernel_us": busy, "idle_us": idle,
               "idle_before_first_kernel_us": first_gap, "kernels": len(kernels)}
    return summary, lines


def host_op_lines(events: list[dict], start: float, end: float, limit: int) -> list[str]:
    """The step's outermost host ops (aten ops and autograd functions called from Python), in order."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and start <= e["ts"] < end and e.get("dur")),
                 key=lambda e: e["ts"])
    lines, covered_until = [], start
    for op in ops:
        if op["ts"] >= covered_until:
            lines.append(f"{op['ts'] - start:10.1f} {op['dur']:9.1f}  {op['name'][:100]}")
            covered_until = op["ts"] + op["dur"]
    return lines[:limit]


def kernel_ms(step, steps: int = 10) -> float:
    """Median over `steps` profiled calls of the GPU time of the kernels each call launched
    (their durations summed): what the step costs the GPU, whatever its host overhead."""
    import statistics

    for _ in range(3):  # compile and warm up outside the profile
        step()
    summaries = [step_lines(start, kernels)[0] for start, _, kernels in _steps(_trace_events(step, steps))]
    return statistics.median(s["kernel_us"] for s in summaries) / 1e3


def write_timeline(step, path: str, *, steps: int = 3, host_ops: int = 60) -> list[dict]:
    """Profile `steps` calls of `step`; write their kernel timelines and the first `host_ops`
    host ops of each to `path`; return the steps' summaries."""
    events = _trace_events(step, steps)
    summaries = []
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for i, (start, end, kernels) in enumerate(_steps(events)):
            summary, lines = step_lines(start, kernels)
            summaries.append(summary)
            f.write(f"# step {i}: " + ", ".join(f"{key} {value:.1f}" for key, value in summary.items()) + "\n")
            f.write(f"{'start µs':>10s} {'dur µs':>9s} {'gap µs':>8s}  kernel\n")
            f.write("\n".join(lines) + "\n")
            f.write(f"# step {i}, host ops\n{'start µs':>10s} {'dur µs':>9s}  op\n")
            f.write("\n".join(host_op_lines(events, start, end, host_ops)) + "\n\n")
    return summaries
