"""End to end on one host's GPUs: the same job (a ViT-L-class encoder, hundreds of image tokens
per sample, the ~1B-active MoE LLM of bench/llm_step.py), run
  (a) homogeneous, colocated: both pools on both GPUs with one layout (encoder dp=2, LLM dp=2,
      with or without ep=2; rank r of each pool on GPU r), and
  (b) heterogeneous, non-colocated: the encoder pool on GPU 0, the LLM pool on GPU 1.
Same global batch (so the same math): `--global-batch` samples a step (16 unless set), eight in
every layout's LLM microbatch, so more samples mean more microbatches a step. Reports tokens/s,
model TFLOP/s per GPU, and the LLM's exposed boundary wait as a share of the step (its GPU's idle
time while its worker waited for rows, `dyad/exposed_wait.py`; of it, the wait for the step's
first microbatch, the pipeline's fill; likewise the encoder's for gradients); keeps each run's
metrics; rewrites --out after each layout.

Workloads (--workload): `vit-l-448-merge2` (default; InternVL-like: a ViT-L/14 at 448 pixels, 1,024
patches per image, 2 x 2 patches merged into each of 256 LLM tokens), where the encoder's share
of the work is about the LLM's (on two H200s the LLM's GPU time was about 1.3x the encoder's);
`vit-l-672-merge2` (Qwen2-VL-like native resolution: 672 pixels, 2,304 patches, 576 LLM tokens an
image, sequences up to 2,048 tokens), where the encoder's attention over more patches shifts the
work towards it; `vit-l-560-merge2` (560 pixels, 1,600 patches, 400 LLM tokens an image), between
the two; `vit-l-224` (256 patches, all sent to the LLM), where the LLM does three
quarters of it.

    python bench/e2e_hetero.py --out $OUT/e2e.json --work $OUT/runs
    python bench/e2e_hetero.py --compile --global-batch 64 --layouts heterogeneous homogeneous-colocated
    python bench/e2e_hetero.py --toy                  # CPU, tiny, one process per pool (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path

from dyad import config as config_lib
from dyad.app.jobs import run_job
from dyad.data import make_dataset
from dyad.encoder_service.hf_config import image_tokens
from dyad.router.encoder_cost import image_cost

COMMON = [
    "train.device=cuda",
    "train.dtype=bfloat16",
    "train.global_batch=16",  # main() puts --global-batch after it
    "train.warmup_steps=2",
    "checkpoint.interval_steps=0",
    "data.multi_image_fraction=0.5",
    "data.max_images_per_sample=2",
    "encoder.patch_size=14",
    "encoder.dim=1024",
    "encoder.depth=24",
    "encoder.heads=16",
    "llm.dim=2048",
    "llm.n_layers=20",
    "llm.n_heads=16",
    "llm.n_kv_heads=4",
    "llm.dense_ffn_dim=5632",
    "llm.max_seq_len=1024",
    "llm.moe.num_experts=16",
    "llm.moe.top_k=4",
    "llm.moe.expert_dim=1408",
    "router.step_timeout_s=600",
    # A layout that fails is reported, not retried: two H100s spent minutes on three recoveries
    # of plain dp2 running out of memory, each restart compiling the blocks again.
    "router.max_recoveries=0",
]
VIT_L_224 = [*COMMON, "data.image_size=224", "encoder.image_size=224"]
VIT_L_448_MERGE2 = [*COMMON, "data.image_size=448", "encoder.image_size=448", "encoder.spatial_merge=2"]
VIT_L_672_MERGE2 = [
    *COMMON, "data.image_size=672", "encoder.image_size=672", "encoder.spatial_merge=2", "llm.max_seq_len=2048"
]
VIT_L_560_MERGE2 = [
    *COMMON, "data.image_size=560", "encoder.image_size=560", "encoder.spatial_merge=2", "llm.max_seq_len=2048"
]
WORKLOADS = {
    "vit-l-448-merge2": VIT_L_448_MERGE2,
    "vit-l-560-merge2": VIT_L_560_MERGE2,
    "vit-l-672-merge2": VIT_L_672_MERGE2,
    "vit-l-224": VIT_L_224,
}
TOY = ["train.global_batch=8", "train.device=cpu"]

SAMPLES_PER_MICROBATCH = 8  # every layout's LLM microbatch, whatever the global batch: the same math


def microbatches(global_batch: int, llm_dp: int, samples_per_microbatch: int = SAMPLES_PER_MICROBATCH) -> str:
    """The `train.microbatches` override giving each LLM microbatch `samples_per_microbatch`
    samples when `llm_dp` data-parallel lanes share `global_batch`."""
    per_lane, rest = divmod(global_batch, llm_dp * samples_per_microbatch)
    if rest or per_lane < 1:
        raise SystemExit(
            f"--global-batch {global_batch}: not a multiple of {llm_dp} lanes x {samples_per_microbatch} samples"
        )
    return f"train.microbatches={per_lane}"


DP2 = ["parallel.encoder.dp=2", "parallel.llm.dp=2"]  # both pools on both GPUs, rank r on GPU r
HETERO = ["parallel.encoder_devices=[0]", "parallel.llm_devices=[1]"]
LAYOUTS = {  # name: (overrides, LLM data-parallel lanes, samples per LLM microbatch); two GPUs each
    "homogeneous-colocated": (DP2, 2, SAMPLES_PER_MICROBATCH),
    # dp2 where its memory does not fit an 80 GB GPU at 32 samples or more: the encoder's blocks
    # (most of a GPU's activations) recompute in the backward pass, or both pools' blocks
    "homogeneous-colocated-recompute-encoder": ([*DP2, "train.recompute=[encoder]"], 2, SAMPLES_PER_MICROBATCH),
    "homogeneous-colocated-recompute-both": ([*DP2, "train.recompute=[encoder, llm]"], 2, SAMPLES_PER_MICROBATCH),
    "homogeneous-colocated-ep2": ([*DP2, "parallel.llm.ep=2"], 2, SAMPLES_PER_MICROBATCH),
    # dp2 fitting an 80 GB GPU by halving its LLM microbatches instead (which changes which tokens
    # share a load-balancing loss: compare it with heterogeneous-4mb for the same math)
    "homogeneous-colocated-4mb": (DP2, 2, SAMPLES_PER_MICROBATCH // 2),
    "heterogeneous": (HETERO, 1, SAMPLES_PER_MICROBATCH),
    "heterogeneous-4mb": (HETERO, 1, SAMPLES_PER_MICROBATCH // 2),
}


def layouts_for(global_batch: int, names: list[str] | None = None) -> dict:
    """name: (overrides, GPUs used) of the layouts named (all when none), in the order named, at
    `global_batch` samples a step; only those are checked against it."""
    return {
        name: ([*overrides, microbatches(global_batch, lanes, samples)], 2)
        for name, (overrides, lanes, samples) in chosen_layouts(LAYOUTS, names).items()
    }


TOY_LAYOUTS = {"toy": (["train.microbatches=2"], 1)}


def encoder_flops_per_image(cfg, tokens: int | None = None) -> float:
    """Forward + backward (x3) of the ViT's matmuls and attention over its patches, and of the
    projector over the (merged) tokens it sends, per image; a native-resolution tower
    (`cfg.native`) by the image's LLM `tokens`: its blocks and attention (`image_cost`'s
    multiply-adds) and its mergers (the main one and DeepStack's)."""
    if cfg.native is not None:
        native = cfg.native
        merger = native.merged_dim * native.merged_dim + native.merged_dim * native.out_dim
        mergers = (1 + len(native.deepstack_layers)) * tokens * merger
        return 6 * (image_cost(cfg)(tokens) + mergers)
    patches = cfg.patches_per_image
    block_params = cfg.depth * (4 * cfg.dim * cfg.dim + 2 * cfg.dim * cfg.mlp_dim)
    projector_params = cfg.merged_dim * cfg.out_dim + cfg.out_dim * cfg.out_dim
    attention = 12 * cfg.depth * cfg.dim * patches * patches
    return 6 * (patches * block_params + cfg.tokens_per_image * projector_params) + attention


def llm_flops_per_token(cfg, seq_len: float) -> float:
    from llm_step import active_parameters  # beside this script

    return 6 * active_parameters(cfg) + 12 * cfg.n_layers * cfg.dim * seq_len


def summarize(config, records: list[dict], gpus: int, skip: int, profiled: int | None = None) -> dict:
    """Medians over the steps after the first `skip` of `records` (the run's step metrics),
    leaving out the `profiled` step (the profiler slows it); each pool's peak memory, the most
    of any rank over all of `records`."""
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    tokens_of = image_tokens(resolved.encoder, dataset)
    samples = {}
    for line in (Path(config.out_dir) / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        samples[record["step"]] = record["samples"]
    rows = []
    for metrics in records[skip:]:
        if metrics["step"] == profiled:
            continue
        shapes = [dataset.shape(s, tokens_of) for s in samples[metrics["step"]]]
        images = sum(shape.n_images for shape in shapes)
        mean_seq = statistics.mean(shape.seq_len for shape in shapes)
        encoder_flops = sum(encoder_flops_per_image(resolved.encoder, tokens_of(image))
                            for s in samples[metrics["step"]] for image in dataset.sample(s).image_ids)
        flops = encoder_flops + metrics["tokens"] * llm_flops_per_token(resolved.llm, mean_seq)
        rows.append(
            {
                "step_s": metrics["step_time_s"],
                "tokens_per_s": metrics["tokens_per_s"],
                "tflops_per_gpu": flops / metrics["step_time_s"] / gpus / 1e12,
                "llm_wait_share": metrics["llm_wait_s"] / metrics["step_time_s"],
                "llm_fill_wait_share": metrics["llm_fill_wait_s"] / metrics["step_time_s"],
                "encoder_wait_share": metrics["encoder_wait_s"] / metrics["step_time_s"],
                "images": images,
                "tokens": metrics["tokens"],
            }
        )
    peaks = {
        f"{pool}_peak_memory_gb": max(metrics[f"{pool}_peak_memory_gb"] for metrics in records)
        for pool in ("encoder", "llm")
    }
    medians = {name: statistics.median(r[name] for r in rows) for name in rows[0]}
    return medians | peaks | {"steps_measured": len(rows)}


def run_layout(
    base: list[str],
    overrides: list[str],
    name: str,
    gpus: int,
    steps: int,
    skip: int,
    work: Path,
    profiled: int | None = None,
    config_name: str | None = None,
) -> dict:
    """One run of the job under `overrides`, summarized over its steps after the first `skip`, or
    {"error": ...}. The run is stopped once `steps` steps are done: it never writes its final
    checkpoint (time, disk, and a full-size gather on every rank that a model needing expert
    parallelism has no memory for). `config_name`: the config the overrides apply to (a file, or
    one dyad ships; default digits)."""
    config = config_lib.load(config_name, [*base, *overrides, f"train.steps={steps + 1}"])
    config = dataclasses.replace(config, out_dir=str((work / name.replace(" ", "-")).resolve()))
    job = run_job(config, progress=False, stop_after=steps - 1)
    measured = [m for m in job.metrics if m["step"] < steps]
    if len(measured) < steps:
        error = f"{len(measured)} of {steps} steps done: {job.info.message}"
        print(f"{name}: FAILED {error[:500]}")
        return {"error": error}
    result = summarize(config, measured, gpus, skip, profiled)
    print(f"{name}: {result['step_s']:.3f} s/step, {result['tokens_per_s']:.0f} tokens/s, "
          f"{result['tflops_per_gpu']:.1f} TFLOP/s per GPU", flush=True)
    return result


def print_table(results: dict[str, dict]) -> None:
    print(
        f"{'layout':24s} {'step s':>7s} {'tokens/s':>9s} {'TFLOP/s/GPU':>12s} {'LLM wait':>9s} {'of it fill':>10s}"
        f" {'enc wait':>9s}"
        f" {'LLM GB':>7s} {'enc GB':>7s}"
    )
    for name, r in results.items():
        if "error" not in r:
            print(
                f"{name:24s} {r['step_s']:7.3f} {r['tokens_per_s']:9.0f} {r['tflops_per_gpu']:12.1f} "
                f"{r['llm_wait_share']:9.1%} {r['llm_fill_wait_share']:10.1%} {r['encoder_wait_share']:9.1%}"
                f" {r['llm_peak_memory_gb']:7.1f} {r['encoder_peak_memory_gb']:7.1f}"
            )


def write_results(path: str, toy: bool, base: list[str], **results) -> None:
    with open(path, "w") as f:
        json.dump({"device": "cpu" if toy else "gpu", **results, "config": base}, f, indent=1)


def run_arguments(*, steps: int, skip: int) -> argparse.ArgumentParser:
    """A parser with the options every end-to-end script takes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true", help="CPU, tiny model (CI)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--skip", type=int, default=skip, help="warm-up steps left out of the medians")
    parser.add_argument("--work", help="run directories (default: a temporary one)")
    parser.add_argument("--out")
    parser.add_argument("--compile", action="store_true", help="train.compile=true (GPU runs; toy runs stay eager)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run, e.g. train.working_weights=true")
    return parser


def with_compile(base: list[str], args) -> list[str]:
    return [*base, "train.compile=true"] if args.compile else base


def chosen_layouts(layouts: dict, names: list[str] | None) -> dict:
    """The layouts to run, in the order named (to alternate which runs first between runs);
    all of them, in their own order, when none are named."""
    if not names:
        return layouts
    unknown = [name for name in names if name not in layouts]
    if unknown:
        raise SystemExit(f"--layouts: no layout named {', '.join(unknown)}; there are {', '.join(layouts)}")
    return {name: layouts[name] for name in dict.fromkeys(names)}


def main() -> None:
    parser = run_arguments(steps=12, skip=3)
    parser.add_argument("--layouts", nargs="*", help="run only these layouts, in this order (default: all)")
    parser.add_argument(
        "--profile-step",
        type=int,
        help="every worker writes a kernel table and a timeline (Chrome trace) of this step "
        "(left out of the medians)",
    )
    parser.add_argument("--profile-dir", help="where the kernel tables and timelines go (a folder per layout)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="vit-l-448-merge2")
    parser.add_argument("--global-batch", type=int, default=16,
                        help=f"samples a step; every layout's LLM microbatches keep {SAMPLES_PER_MICROBATCH} samples "
                        "(the -4mb layouts: half), so more samples mean more microbatches a step")
    args = parser.parse_args()
    if args.toy:
        base, layouts = TOY, chosen_layouts(TOY_LAYOUTS, args.layouts)
    else:
        base = [*with_compile(WORKLOADS[args.workload], args), f"train.global_batch={args.global_batch}"]
        layouts = layouts_for(args.global_batch, args.layouts)
    base = [*base, *args.set]
    steps, skip = (3, 1) if args.toy else (args.steps, args.skip)
    work = Path(args.work or tempfile.mkdtemp(prefix="dyad-e2e-"))
    results = {}
    for name, (overrides, gpus) in layouts.items():
        if args.profile_step is not None:  # read by the workers (dyad/app/worker.py)
            profile_dir = Path(args.profile_dir or work) / f"profile-{name}"
            profile_dir.mkdir(parents=True, exist_ok=True)
            os.environ.update(
                DYAD_PROFILE_DIR=str(profile_dir),
                DYAD_PROFILE_STEP=str(args.profile_step),
            )
        results[name] = run_layout(base, overrides, name, gpus, steps, skip, work, args.profile_step)
        if args.out:  # after every layout, so a run cut short keeps what it measured
            write_results(args.out, args.toy, base, layouts=results)
    print_table(results)


if __name__ == "__main__":
    main()
