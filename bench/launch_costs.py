"""Host time of one launch of each op before the MoE layer's first expert GEMM, with the GPU
kept busy, so that the time is the host's alone: what the layer's step exposes when it starts
from an idle GPU (`bench/moe_layer.py` without `--head-start`). Mixtral-like routing shape.

    python bench/launch_costs.py --out $OUT/launch_costs.json     # on a GPU host
    python bench/launch_costs.py --toy                             # CPU (CI: keeps it working)

Each row is the median over `--iters` calls, after warm-up, with about 30 ms of matmuls queued
first (on CPU nothing is queued and each time includes the op's work).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from moe_layer import SHAPES, TOY, _queue_busy_work  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script

from dyad.kernels import moe_permute, moe_router


def ops(device: str, shape: tuple) -> dict:
    dim, _, experts, top_k, tokens = shape
    act = torch.bfloat16 if device == "cuda" else torch.float32
    x_TD = torch.randn(tokens, dim, device=device, dtype=act)
    w_ED = torch.randn(experts, dim, device=device, dtype=act) * 0.02
    logits_TE = torch.randn(tokens, experts, device=device)
    flat_N = torch.randint(0, experts, (tokens * top_k,), device=device)
    small = torch.randn(16, device=device)
    rows = {
        "a small add (torch)": lambda: small + small,
        "torch.empty": lambda: torch.empty(tokens, experts, device=device),
        "F.linear (cuBLAS on CUDA)": lambda: F.linear(x_TD, w_ED),
        "router_logits (autograd Function)": lambda: moe_router.router_logits(x_TD, w_ED),
        "softmax_topk (autograd Function)": lambda: moe_router.softmax_topk(logits_TE, top_k),
        "route_softmax_topk (both in one launch)": lambda: moe_router.route_softmax_topk(x_TD, w_ED, top_k),
        "argsort, stable": lambda: torch.argsort(flat_N, stable=True),
        "expert_counts": lambda: moe_permute.expert_counts(flat_N, experts),
        "cumsum to int32": lambda: torch.cumsum(small, 0, dtype=torch.int32),
    }
    if device == "cuda":  # the Triton launches alone, no autograd
        rows["fused_logits (one Triton launch)"] = lambda: moe_router.fused_logits(x_TD, w_ED)
        rows["expert_plan (one Triton launch)"] = lambda: moe_permute.expert_plan(flat_N, experts)
    return rows


def host_us(fn, device: str, iters: int) -> float:
    for _ in range(5):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        _queue_busy_work(matmuls=20)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true", help="small shape on CPU (keeps the script working)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", help="write results as JSON here")
    args = parser.parse_args()
    device = bench_device(args.toy)
    shape = SHAPES["mixtral-like"] if device == "cuda" else TOY["toy"]
    results = {**run_header(device), "shape": dict(zip(("dim", "hidden", "experts", "top_k", "tokens"), shape)), "us": {}}
    for name, fn in ops(device, shape).items():
        results["us"][name] = host_us(fn, device, args.iters)
        print(f"{name:36s} {results['us'][name]:8.1f} µs host", flush=True)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
