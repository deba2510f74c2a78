"""The SM clock and power a GPU holds while one MoE layer's step runs back to back, per layer (same
shape, bf16, `moe_layer.py`'s layers): at the board's power limit the clock is what the work
leaves, so two layers with the same GEMMs can run them at different speeds. Samples
`nvidia-smi` every 100 ms over a few seconds of steps per layer, in turn, twice.

    python bench/layer_clocks.py --out $OUT/layer_clocks.json             # on a GPU host
    python bench/layer_clocks.py --toy                                     # CPU, tiny, no clocks (CI)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time

import torch
from moe_layer import LAYERS, SHAPES, TOY, layer_step  # beside this script
from run_info import bench_device, write_json  # beside this script

SAMPLE_MS = 100
WARMUP_SAMPLES = 5  # the first half second after the monitor starts


def sample_while(step, seconds: float) -> tuple[float, list[tuple[float, float]]]:
    """Run `step` for `seconds`; return ms per step and the (SM MHz, W) samples taken meanwhile."""
    monitor = None
    if shutil.which("nvidia-smi") and torch.cuda.is_available():
        monitor = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", f"-lms={SAMPLE_MS}"],
            stdout=subprocess.PIPE, text=True,
        )
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    if monitor is None:
        return ms, []
    monitor.terminate()
    lines = monitor.stdout.read().strip().splitlines()[WARMUP_SAMPLES:]
    return ms, [tuple(float(v) for v in line.split(",")) for line in lines if line.count(",") == 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true", help="tiny shape on CPU (keeps the script working)")
    parser.add_argument("--seconds", type=float, default=8.0, help="of steps per layer and round")
    parser.add_argument("--layers", default="dyad,torchtitan-0.3.0")
    parser.add_argument("--shape", default="mixtral-like")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = TOY["toy"] if device == "cpu" else SHAPES[args.shape]
    seconds = 0.2 if args.toy else args.seconds
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "shape": args.shape if device == "cuda" else "toy", "rounds": []}
    print(f"{'layer':18s} {'ms/step':>8s} {'SM MHz (median, min)':>21s} {'W (median)':>11s}")
    for _ in range(2):
        for name in args.layers.split(","):
            step = layer_step(LAYERS[name], shape, device, dtype)
            for _ in range(5):
                step()
            ms, samples = sample_while(step, seconds)
            clocks, watts = [c for c, _ in samples], [w for _, w in samples]
            row = {"layer": name, "ms": ms, "sm_mhz_median": statistics.median(clocks) if clocks else None,
                   "sm_mhz_min": min(clocks) if clocks else None, "watts_median": statistics.median(watts) if watts else None}
            results["rounds"].append(row)
            clock = f"{row['sm_mhz_median']:.0f}, {row['sm_mhz_min']:.0f}" if clocks else "-"
            power = f"{row['watts_median']:.0f}" if watts else "-"
            print(f"{name:18s} {ms:8.2f} {clock:>21s} {power:>11s}")
            del step
            if device == "cuda":
                torch.cuda.empty_cache()
    write_json(args.out, results)


if __name__ == "__main__":
    main()
