"""End-to-end smoke run on a GPU host: the default job with `train.device=cuda`.

1. `dyad verify`-equivalent: N steps disaggregated vs the single-process reference, on CUDA.
2. The full default job on CUDA: steps/s, final loss and held-out caption accuracy.

    python bench/gpu_smoke.py --out $OUT/gpu_smoke.json

Prints a table and writes JSON. Not a performance benchmark: the digits model is tiny, so the
step time is dominated by control-plane round trips and kernel launches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dyad import config as config_lib
from dyad.app.jobs import run_job
from dyad.app.verify import compare_with_reference
from dyad.data import make_dataset


def _config(out_dir: Path, overrides: list[str]):
    config = config_lib.load(None, ["train.device=cuda", *overrides])
    return dataclasses.replace(config, out_dir=str(out_dir))


def verify(work: Path, steps: int) -> dict:
    config = _config(work / "verify", [f"train.steps={steps}"])
    job = run_job(config, progress=False)
    if not job.succeeded:
        return {"succeeded": False, "message": job.info.message}
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    comparison = compare_with_reference(resolved, dataset, job)
    return {
        "succeeded": True,
        "losses": comparison.losses,
        "worst_loss_error": comparison.worst_loss_error,
        "worst_param_error": comparison.worst_param_error,
        "worst_param": comparison.worst_param,
    }


def train(work: Path) -> dict:
    config = _config(work / "train", [])
    started = time.perf_counter()
    job = run_job(config, progress=False)
    wall_s = time.perf_counter() - started
    if not job.succeeded:
        return {"succeeded": False, "message": job.info.message}
    final = job.evaluations[-1]  # the run's own, at its end (eval.final)
    step_times = [m["step_time_s"] for m in job.metrics[10:]]
    return {
        "succeeded": True,
        "steps": len(job.metrics),
        "wall_s": wall_s,
        "median_step_s": statistics.median(step_times),
        "final_loss": job.metrics[-1]["loss"],
        "heldout_loss": final["loss"],
        "caption_accuracy": final["accuracy"],
        "heldout_samples": final["answered"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--verify-steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_smoke needs a CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "verify": verify(Path(tmp), args.verify_steps),
            "train": train(Path(tmp)),
        }
    Path(args.out).write_text(json.dumps(result, indent=1))
    v, t = result["verify"], result["train"]
    print(f"GPU: {result['gpu']}  torch {result['torch']}")
    if v["succeeded"]:
        print(f"verify ({args.verify_steps} steps, fp32): worst loss rel. error "
              f"{v['worst_loss_error']:.2e}, worst parameter rel. error "
              f"{v['worst_param_error']:.2e} ({v['worst_param']})")
    else:
        print(f"verify failed: {v['message']}")
    if t["succeeded"]:
        print(f"train: {t['steps']} steps in {t['wall_s']:.1f}s (median step {t['median_step_s']*1e3:.1f} ms), "
              f"final loss {t['final_loss']:.4f}, caption_accuracy {t['caption_accuracy']:.3f}")
    else:
        print(f"train failed: {t['message']}")


if __name__ == "__main__":
    main()
