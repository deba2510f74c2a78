"""Encoder imbalance, measured: a step's images of skewed native-resolution sizes spread over G
encoder data-parallel groups by the router's plan (`dyad.router.boundary.plan_boundary`), once
per way of counting what an image costs: by `count` (every image 1), by `tokens` (the plan's
default) and by `cost` (`dyad.router.encoder_cost.image_cost`: patches plus the quadratic
attention term, what the router uses). Each group's share is then timed on the tower it runs:
forward + backward of each of its microbatches' images as one packed call (pixel_values and
grid_thw, as the encoder rank runs them), one group after another on the one GPU, every group of
every assignment in turn so that clock drift falls on all alike. The step's encoder time is its
slowest group's, as if each group were its own rank.

The tower is Qwen3-VL-30B-A3B's (bench/vision_tower.py's `TOWER`: random weights saved by
transformers, loaded by `dyad.hf.load`), bf16. The step: `MIX`, drawn with `--seed` and shuffled
(many thumbnails and icons, some screenshots and photos, a few page scans; ~52,000 patches at
seed 0), split into `--microbatches` contiguous microbatches as the router's sampler splits them;
the plan assigns each microbatch's images in turn, carrying the groups' loads over the step.

    python bench/encoder_balance.py --out $OUT/encoder_balance.json             # on a GPU host
    python bench/encoder_balance.py --compile --out $OUT/encoder_balance.json   # each block compiled
    python bench/encoder_balance.py --toy                                       # CPU, tiny, float32 (CI)

Reports per assignment and group: images, patches, predicted cost (forward multiply-adds), the
measured median ms; the predicted imbalance (max / mean of cost) beside the measured one (max /
mean of ms); and how well cost predicts time: measured ms per 10^9 predicted multiply-adds of
every group, and their spread (max / min).
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
from moe_layer import time_interleaved  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script
from vision_tower import TOWER, TOY, backward, packed_images, random_towers  # beside this script

from dyad.compile import compile_blocks
from dyad.layout import EncoderLayout, LLMLayout
from dyad.router.boundary import BoundaryPlan, ImageSlot, PlannedMicrobatch, PlannedSample, plan_boundary
from dyad.router.encoder_cost import image_cost
from dyad.router.sampler import split_microbatches

# (images, (rows low, high), (columns low, high)) in patches, even sides (the 2 x 2 merge)
MIX = [(40, (8, 24), (8, 24)),  # thumbnails and icons: 128-384 pixels a side
       (12, (24, 48), (24, 56)),  # screenshots and photos
       (4, (72, 100), (52, 76))]  # page scans: up to 1,600 x 1,216 pixels
TOY_MIX = [(10, (2, 4), (2, 4)), (4, (4, 8), (4, 8)), (2, (8, 12), (6, 8))]


def draw_sizes(mix: list, seed: int) -> list[tuple[int, int]]:
    """The step's images' (patch rows, columns), in the order they arrive."""
    rng = random.Random(seed)
    sizes = [(2 * rng.randint(rows[0] // 2, rows[1] // 2), 2 * rng.randint(cols[0] // 2, cols[1] // 2))
             for count, rows, cols in mix for _ in range(count)]
    rng.shuffle(sizes)
    return sizes


def planned_step(tokens: list[int], microbatches: int) -> list[PlannedMicrobatch]:
    """The step as the router plans it, each image a sample of its own: only the images' tokens
    enter the encoder's assignment, not the text around them."""
    parts = split_microbatches(range(len(tokens)), microbatches)
    return [PlannedMicrobatch(index, 0, tuple(PlannedSample(i, tokens[i], (ImageSlot(i, tokens[i], 0),)) for i in part))
            for index, part in enumerate(parts)]


def group_images(plan: BoundaryPlan, group: int) -> list[list[int]]:
    """The image ids of each microbatch the group encodes, in the plan's order."""
    return [[image.image_id for image in work.images] for work in plan.encoder_work if work.encoder_dp_rank == group]


def imbalance(loads: list[float]) -> float:
    return max(loads) * len(loads) / sum(loads)


def assignment_result(shares: list[list[list[int]]], ms: list[float], cost, tokens, sizes) -> dict:
    """Per group (its microbatches' image ids `shares[g]`, its measured `ms[g]`): images, patches,
    predicted cost and ms; and the assignment's imbalance, predicted and measured, and step time."""
    groups = []
    for ids, group_ms in zip(([i for mb in share for i in mb] for share in shares), ms, strict=True):
        group_cost = sum(cost(tokens[i]) for i in ids)
        groups.append({"images": len(ids), "patches": sum(sizes[i][0] * sizes[i][1] for i in ids),
                       "cost": group_cost, "ms": group_ms, "ms_per_gmac": group_ms / group_cost * 1e9 if ids else None})
    return {"groups": groups, "predicted_imbalance": imbalance([g["cost"] for g in groups]),
            "measured_imbalance": imbalance([g["ms"] for g in groups]), "step_ms": max(ms)}


def cost_tracks_time(assignments: dict) -> dict:
    """Measured ms per 10^9 predicted multiply-adds over every group that ran: where cost predicts
    time, they are alike (spread near 1)."""
    rates = [g["ms_per_gmac"] for a in assignments.values() for g in a["groups"] if g["ms_per_gmac"] is not None]
    mean = statistics.mean(rates)
    return {"ms_per_gmac_min": min(rates), "ms_per_gmac_max": max(rates), "ms_per_gmac_mean": mean,
            "spread": max(rates) / min(rates), "relative_stdev": statistics.pstdev(rates) / mean}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="each block compiled, as train.compile does")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape, mix = (TOWER, MIX) if device == "cuda" else (TOY, TOY_MIX)
    if device == "cpu":  # a tiny tower gains nothing from threads, which spin for 100s of ms on a busy CI host
        torch.set_num_threads(1)
    torch.manual_seed(0)
    _, (tower,) = random_towers(shape, dtype, device)
    if args.compile:
        compile_blocks(tower.model)
    cost = image_cost(tower.model.cfg)  # the Qwen3VLVisionConfig dyad.hf.load read from the save
    sizes = draw_sizes(mix, args.seed)
    tokens = [h * w // shape["spatial_merge_size"] ** 2 for h, w in sizes]
    step = planned_step(tokens, args.microbatches)
    weigh = {"count": lambda t: 1.0, "tokens": float, "cost": cost}
    plans = {name: plan_boundary(step, encoder=EncoderLayout(dp=args.groups), llm=LLMLayout(),
                                 hidden=shape["out_hidden_size"], element_size=dtype.itemsize, image_cost=fn)
             for name, fn in weigh.items()}
    shares = {name: [group_images(plan, g) for g in range(args.groups)] for name, plan in plans.items()}

    def group_step(batches):
        def run():  # a microbatch a call, as the encoder rank runs its work
            for pixels, grid_thw, upstream in batches:
                backward(tower(pixels, grid_thw), upstream)
        return run

    # A group of every assignment in turn (count/0, tokens/0, cost/0, count/1, ...); an empty group is not run.
    steps = {f"{name}/{g}": group_step([packed_images(shape, [sizes[i] for i in ids], dtype, device)
                                        for ids in shares[name][g]])
             for g in range(args.groups) for name in plans if shares[name][g]}
    ms = time_interleaved(steps, args.iters, device)
    assignments = {name: assignment_result(shares[name], [ms.get(f"{name}/{g}", 0.0) for g in range(args.groups)],
                                           cost, tokens, sizes)
                   for name in plans}
    result = {**run_header(device), "tower": shape, "compiled": args.compile, "groups": args.groups,
              "microbatches": args.microbatches, "seed": args.seed, "iters": args.iters, "sizes": sizes,
              "patches": sum(h * w for h, w in sizes), "assignments": assignments,
              "cost_tracks_time": cost_tracks_time(assignments),
              "step_speedup_of_cost": {name: a["step_ms"] / assignments["cost"]["step_ms"]
                                       for name, a in assignments.items()}}
    print_summary(result)
    write_json(args.out, result)


def print_summary(result: dict) -> None:
    print(f"{len(result['sizes'])} images, {result['patches']} patches, {result['microbatches']} microbatches over "
          f"{result['groups']} encoder groups, fwd+bwd{' compiled' if result['compiled'] else ''}:")
    for name, a in result["assignments"].items():
        print(f"  by {name:6}: imbalance predicted {a['predicted_imbalance']:.3f}, measured "
              f"{a['measured_imbalance']:.3f}; step {a['step_ms']:.1f} ms; groups (images, ms): "
              + ", ".join(f"{g['images']} {g['ms']:.1f}" for g in a["groups"]))
    tracking, speedup = result["cost_tracks_time"], result["step_speedup_of_cost"]
    print(f"  ms per 1e9 predicted multiply-adds over the groups: {tracking['ms_per_gmac_min']:.4g}-"
          f"{tracking['ms_per_gmac_max']:.4g} (spread {tracking['spread']:.3f}x, relative stdev "
          f"{tracking['relative_stdev']:.3f}); the step by cost is {speedup['count']:.2f}x as fast as by count, "
          f"{speedup['tokens']:.2f}x as by tokens")


if __name__ == "__main__":
    main()
