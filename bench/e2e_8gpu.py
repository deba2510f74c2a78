"""End to end on one host's G GPUs (issue 8: eight H200s): a scaled-up vision-heavy job, run
  homogeneous: both pools on all G GPUs, colocated (encoder dp=G; the LLM on G ranks, rank r of
      each pool on GPU r), and
  heterogeneous, non-colocated: the encoder pool on the first E GPUs, the LLM pool on the next L
      (`--pools 2+6,1+7`),
each with a sweep of the LLM pool's layout: every (ep, tp, cp) of the given degrees that the layout
and the model accept (`LLMLayout`, `validate_llm_layout`), dp the rest; the encoder pool is
data-parallel over its GPUs (its tp is not swept). The best layout of each
pool split is the one with the lowest median step time. Reports tokens/s and model TFLOP/s per GPU
(bench/e2e_hetero.py's counting), the LLM's exposed boundary wait, for every run and the best.

The workload: a ViT-H/14-class encoder (dim 1280, 32 layers, 0.64 B parameters) on 336-pixel
images (576 tokens each, 1.5 images per sample on average) and the MoE LLM of bench/e2e_hetero.py
with 24 layers instead of 20 and 56 experts instead of 16: 1.08 B active of 11.4 B parameters.
At 16 bytes a parameter (float32 weights and gradients, AdamW's two moments) that is 183 GB, more
than one H200 holds (141 GB), so the LLM needs ep >= 2; 56 experts allow ep 2, 4, 7 and 8 (a
6-GPU pool: ep 2; a 7-GPU pool: ep 7). Global batch 64 samples everywhere; each LLM data-parallel
rank takes microbatches of about `--microbatch-samples` samples; given several sizes (`4 2`), a
layout that runs out of GPU memory at one is run again at the next (on four H100s the colocated
layout fit only two-sample microbatches, which made it the fastest it could be). Runs are stopped
after their measured steps (no final checkpoint: see `run_layout`).

    NCCL_NVLS_ENABLE=0 python bench/e2e_8gpu.py --out $OUT/e2e_8gpu.json --work $OUT/runs
    python bench/e2e_8gpu.py --toy       # CPU, tiny: homogeneous on 2 ranks (ep 2) and 1+1 (CI)
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import tempfile
from pathlib import Path

from e2e_hetero import (  # beside this script
    TOY,
    VIT_L_224,
    print_table,
    run_arguments,
    run_layout,
    with_compile,
    write_results,
)

from dyad import config as config_lib
from dyad.layout import LLMLayout, validate_llm_layout

LARGER_ENCODER = [
    "data.image_size=336",
    "encoder.image_size=336",
    "encoder.dim=1280",
    "encoder.depth=32",
    "llm.max_seq_len=2048",
]
EIGHT_GPU = [
    *VIT_L_224,
    *LARGER_ENCODER,
    "llm.n_layers=24",
    "llm.moe.num_experts=56",
    "train.global_batch=64",
    # A short run that stays near its starting loss: 1e-3 after two warm-up steps took the loss
    # from 4.2 to 25 in three steps, and a model that diverges routes its tokens unlike one that
    # trains.
    "train.lr=3e-4",
    "train.warmup_steps=20",
    "router.max_recoveries=0",  # a layout that fails (out of memory) is reported, not retried
]
MIN_EP = 2  # the LLM's parameters need at least two GPUs (see above)


def parse_pool(text: str) -> tuple[int, int] | None:
    """'homogeneous' -> None; '2+6' -> (2, 6): encoder GPUs + LLM GPUs."""
    if text == "homogeneous":
        return None
    encoder, _, llm = text.partition("+")
    if not (encoder.isdigit() and llm.isdigit()) or int(encoder) < 1 or int(llm) < 1:
        raise ValueError(f"a pool split is 'homogeneous' or E+L with E, L >= 1, got {text!r}")
    return int(encoder), int(llm)


def pool_overrides(gpus: int, split: tuple[int, int] | None) -> tuple[list[str], int]:
    """The encoder pool's and the device lists' overrides, and the LLM pool's size."""
    if split is None:  # empty device lists: rank r of each pool on GPU r
        return [f"parallel.encoder.dp={gpus}"], gpus
    encoder, llm = split
    if encoder + llm > gpus:
        raise ValueError(f"the split {encoder}+{llm} needs {encoder + llm} GPUs, this host has {gpus}")
    return [
        f"parallel.encoder.dp={encoder}",
        f"parallel.encoder_devices={list(range(encoder))}",
        f"parallel.llm_devices={list(range(encoder, encoder + llm))}",
    ], llm


def llm_layouts(world: int, llm_cfg, tps, cps, eps) -> list[LLMLayout]:
    """Every layout of `world` LLM ranks with tp in `tps`, cp in `cps`, ep in `eps` that the
    layout and the model accept."""
    layouts = []
    for tp, cp, ep in itertools.product(tps, cps, eps):
        if world % (tp * cp):
            continue
        try:
            layout = LLMLayout(tp=tp, cp=cp, dp=world // (tp * cp), ep=ep)
            validate_llm_layout(layout, llm_cfg)
        except ValueError:
            continue
        layouts.append(layout)
    return layouts


def llm_overrides(layout: LLMLayout, global_batch: int, microbatch_samples: int) -> list[str]:
    microbatches = max(1, global_batch // (layout.dp * microbatch_samples))
    degrees = [f"parallel.llm.{axis}={getattr(layout, axis)}" for axis in ("tp", "cp", "dp", "ep")]
    return [*degrees, f"train.microbatches={microbatches}"]


def layout_name(pool: str, layout: LLMLayout, samples: int | None = None) -> str:
    """'2+6 ep2 tp1', with ' mb2' when the sweep tries more than one microbatch size."""
    name = f"{pool} ep{layout.ep} tp{layout.tp}" + (f" cp{layout.cp}" if layout.cp > 1 else "")
    return name if samples is None else f"{name} mb{samples}"


def ran_out_of_memory(run: dict) -> bool:
    """A failed run whose worker ran out of GPU memory (the router's words, or torch's)."""
    return bool(re.search(r"out of (GPU )?memory", run.get("error", ""), re.IGNORECASE))


def run_microbatch_sizes(sizes, run_one) -> dict[int, dict]:
    """`run_one(samples)` for each microbatch size in `sizes`, in order, until one does not run
    out of memory: a layout that fits larger microbatches is not run with smaller ones."""
    runs = {}
    for samples in sizes:
        runs[samples] = run_one(samples)
        if not ran_out_of_memory(runs[samples]):
            break
    return runs


def fastest(runs: dict[str, dict]) -> str | None:
    measured = {name: r["step_s"] for name, r in runs.items() if "error" not in r}
    return min(measured, key=measured.get) if measured else None


def ep_choices(args, llm_world: int):
    if args.ep:
        return args.ep
    if args.toy:  # one run per pool in CI: the experts spread over the whole LLM pool
        return [llm_world]
    return range(MIN_EP, llm_world + 1)


def sweep_pool(pool: str, base: list[str], gpus: int, args, work: Path, done=lambda runs: None) -> dict:
    """Every valid LLM layout of one pool split; the runs and the fastest. `done(runs)` after each
    run, so that a sweep cut short still leaves what it measured."""
    config, split = config_lib.load(None, base), parse_pool(pool)
    encoder_overrides, llm_world = pool_overrides(gpus, split)
    used = gpus if split is None else sum(split)
    eps = ep_choices(args, llm_world)
    layouts = llm_layouts(llm_world, config.llm, args.tp, args.cp, eps)
    if not layouts:
        print(f"{pool}: no LLM layout of {llm_world} ranks with ep in {list(eps)}, tp in {args.tp}, cp in {args.cp}")
        return {
            "error": f"no valid LLM layout of {llm_world} ranks",
            "layouts": {},
            "best": None,
        }
    runs = {}
    sizes = args.microbatch_samples
    for layout in layouts:

        def run_one(samples: int, layout=layout) -> dict:
            name = layout_name(pool, layout, samples if len(sizes) > 1 else None)
            overrides = [*encoder_overrides, *llm_overrides(layout, config.train.global_batch, samples)]
            runs[name] = run_layout(base, overrides, name, used, args.steps, args.skip, work)
            done(runs)
            return runs[name]

        run_microbatch_sizes(sizes, run_one)
    return {"layouts": runs, "best": fastest(runs)}


def print_best(results: dict[str, dict]) -> None:
    best = {pool: r["layouts"][r["best"]] | {"layout": r["best"]} for pool, r in results.items() if r["best"]}
    homogeneous = best.get("homogeneous")
    for pool, r in best.items():
        versus = f", {r['tokens_per_s'] / homogeneous['tokens_per_s']:.2f}x homogeneous" if homogeneous else ""
        print(
            f"best of {pool}: {r['layout']} ({r['tokens_per_s']:.0f} tokens/s, "
            f"{r['tflops_per_gpu']:.1f} TFLOP/s per GPU{versus})"
        )


def main() -> None:
    parser = run_arguments(steps=8, skip=3)
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: all)")
    parser.add_argument("--pools", default="homogeneous,2+6,1+7")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cp", type=int, nargs="+", default=[1])
    parser.add_argument("--ep", type=int, nargs="+", help=f"default: all >= {MIN_EP}")
    parser.add_argument(
        "--microbatch-samples", type=int, nargs="+", default=[4],
        help="samples a LLM microbatch holds, about; several (e.g. 4 2): tried in that order, a "
        "layout's next only when it ran out of GPU memory at the one before",
    )
    args = parser.parse_args()
    if args.toy:
        base, gpus, pools = TOY, 2, ["homogeneous", "1+1"]
        args.tp, args.cp, args.steps, args.skip = [1], [1], 3, 1
    else:
        import torch

        base, gpus, pools = (
            with_compile(EIGHT_GPU, args),
            args.gpus or torch.cuda.device_count(),
            args.pools.split(","),
        )
    base = [*base, *args.set]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the router's workers inherit it
    work = Path(args.work or tempfile.mkdtemp(prefix="dyad-e2e-8gpu-"))
    results = {}

    def save(pool: str, result: dict) -> None:
        results[pool] = result
        if args.out:
            write_results(args.out, args.toy, base, gpus=gpus, pools=results)

    def save_runs(pool: str, runs: dict) -> None:  # a sweep's runs so far
        save(pool, {"layouts": runs, "best": fastest(runs)})

    for pool in pools:
        save(pool, sweep_pool(pool, base, gpus, args, work, functools.partial(save_runs, pool)))
    print_table({name: r for pool in results.values() for name, r in pool["layouts"].items()})
    print_best(results)


if __name__ == "__main__":
    main()
