"""Local workers' CPU threads: the per-rank load of bench/resize.py (one encoder GPU feeding 90
images a step to three LLM GPUs, each training 5 microbatches of 4 samples) run twice through
the router, once with every worker at torch's default thread count (one per CPU, what a worker
got before the launcher gave each its share) and once with the launcher's share
(`router.launcher.worker_threads`). Prints the step time of each and writes JSON.

    NCCL_NVLS_ENABLE=0 python bench/worker_threads.py --out $OUT/worker_threads.json
    python bench/worker_threads.py --toy       # CPU, tiny: one encoder and one LLM rank (CI)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from e2e_8gpu import LARGER_ENCODER  # beside this script
from e2e_hetero import TOY, VIT_L_224, print_table, run_arguments, run_layout, with_compile, write_results

from dyad.cpus import usable_cpus, worker_threads
from dyad.ucx_progress import busy_threads

GPU_POOLS = [
    "train.global_batch=60",
    "parallel.encoder.dp=1",
    "parallel.llm.dp=3",
    "train.microbatches=5",
    "parallel.encoder_devices=[0]",
    "parallel.llm_devices=[1,2,3]",
]
TOY_POOLS = ["train.microbatches=2"]


def torch_default_threads() -> int:
    """What torch uses in a fresh process without OMP_NUM_THREADS."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    probe = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    return int(subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    args = run_arguments(steps=6, skip=2).parse_args()
    gpu_base = with_compile([*VIT_L_224, *LARGER_ENCODER], args)
    base, pools, gpus = (TOY, TOY_POOLS, 2) if args.toy else (gpu_base, GPU_POOLS, 4)
    base = [*base, *args.set]
    steps, skip = (3, 1) if args.toy else (args.steps, args.skip)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    work = Path(args.work or tempfile.mkdtemp(prefix="dyad-threads-"))
    workers = 2 if args.toy else 4
    default, share = torch_default_threads(), worker_threads(usable_cpus(), workers, busy_threads())
    choices = {f"torch default ({default})": default, f"share ({share})": share}
    results = {}
    for name, threads in choices.items():
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the workers inherit it
        results[name] = run_layout(base, pools, name, gpus, steps, skip, work) | {"threads": threads}
    os.environ.pop("OMP_NUM_THREADS")
    print_table(results)
    if args.out:
        write_results(args.out, args.toy, [*base, *pools], cpus=usable_cpus(), runs=results)


if __name__ == "__main__":
    main()
