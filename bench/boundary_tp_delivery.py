"""Which boundary TP delivery is faster here: every LLM tp rank receiving its rows over UCX
("direct"), or tp rank 0 receiving and broadcasting inside the LLM pool ("broadcast")?

Runs the default job for a few steps under each mode with the same layout and prints the median
step time and the LLM's median wait for boundary rows; writes JSON.

    python bench/boundary_tp_delivery.py --steps 40 --out results.json [--set key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from dyad import config as config_lib
from dyad.jobs import run_job

LAYOUT = ["parallel.llm.tp=2", "parallel.llm.cp=2", "parallel.encoder.dp=2", "train.global_batch=16",
          "data.multi_image_fraction=0.3"]


def measure(mode: str, steps: int, extra: list[str], work: Path) -> dict:
    config = config_lib.load(None, [*LAYOUT, *extra, f"train.steps={steps}", f"boundary.tp_delivery={mode}"])
    config = dataclasses.replace(config, out_dir=str(work / mode))
    job = run_job(config, progress=False)
    if not job.succeeded:
        raise SystemExit(f"{mode}: {job.info.message}")
    warm = job.metrics[5:]  # the first steps include process start-up effects
    return {
        "mode": mode,
        "median_step_s": statistics.median(m["step_time_s"] for m in warm),
        "median_llm_wait_s": statistics.median(m["llm_wait_s"] for m in warm),
        "boundary_bytes_fwd": warm[0]["boundary_bytes_fwd"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", required=True)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(mode, args.steps, args.set, Path(tmp)) for mode in ("direct", "broadcast", "direct", "broadcast")]
    Path(args.out).write_text(json.dumps({"layout": LAYOUT + args.set, "results": results}, indent=1))
    print(f"layout: {' '.join(LAYOUT + args.set)}")
    print(f"{'mode':<10} {'median step (ms)':>17} {'median LLM wait (ms)':>21} {'fwd bytes/step':>15}")
    for r in results:
        print(f"{r['mode']:<10} {r['median_step_s'] * 1e3:>17.1f} {r['median_llm_wait_s'] * 1e3:>21.2f} "
              f"{r['boundary_bytes_fwd']:>15.0f}")


if __name__ == "__main__":
    main()
