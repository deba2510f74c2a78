"""The permutation's stable sort of top-k expert ids, on one GPU: `torch.argsort` of the int64 ids
top-k returns against `stable_expert_order` (`dyad/kernels/moe_permute.py`: the same order, sorted
as the narrowest integer type that holds the ids), for the MoE layer benchmark's shapes. Each
row is the kernels' own time, summed from a profile (`kernel_timeline.kernel_ms`); both orders
are checked equal.

    python bench/expert_order.py --out $OUT/expert_order.json     # on a GPU host
    python bench/expert_order.py --toy                             # CPU, tiny (CI)
"""

from __future__ import annotations

import argparse

import torch
from kernel_timeline import kernel_ms  # beside this script
from moe_layer import SHAPES, TOY, median_ms
from run_info import bench_device, run_header, write_json  # beside this script

from dyad.kernels.moe_permute import stable_expert_order


def order_steps(shape, device):
    """{name: step} for both sorts of one shape's routed ids (uniformly random experts)."""
    _, _, experts, top_k, tokens = shape
    ids_N = torch.randint(0, experts, (tokens * top_k,), device=device)
    if not torch.equal(stable_expert_order(ids_N, experts), torch.argsort(ids_N, stable=True)):
        raise AssertionError(f"stable_expert_order differs from the int64 argsort for {shape}")
    return {
        "int64 argsort": lambda: torch.argsort(ids_N, stable=True),
        "stable_expert_order": lambda: stable_expert_order(ids_N, experts),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true", help="tiny shape on CPU (keeps the script working)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", help="write results as JSON here")
    args = parser.parse_args()
    device = bench_device(args.toy)
    shapes = TOY if device == "cpu" else SHAPES
    results = {**run_header(device), "shapes": {}}
    print(f"{'shape':13s} {'rows':>8s} {'sort':22s} {'µs':>8s}")
    for name, shape in shapes.items():
        entry = results["shapes"][name] = {"rows": shape[4] * shape[3], "experts": shape[2]}
        for sort, step in order_steps(shape, device).items():
            ms = kernel_ms(step, args.iters) if device == "cuda" else median_ms(step, args.iters, device)
            entry[sort] = {"us": ms * 1e3}
            print(f"{name:13s} {entry['rows']:8d} {sort:22s} {ms * 1e3:8.1f}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
