"""Where the Mixtral-like MoE layer's floor lies: its three expert GEMMs forward and backward
(SwiGLU between them) on balanced routing, computed three ways on one GPU:

- `grouped`: one `F.grouped_mm` per GEMM over all experts (what dyad's layer runs);
- `looped`: one cuBLAS `torch.mm` per expert and GEMM (row counts known on the host);
- `dense`: one `torch.mm` over all rows with one expert's weights (the same FLOPs in the
  largest GEMMs; no layer can beat it).

    python bench/expert_gemms.py --out $OUT/expert_gemms.json
    python bench/expert_gemms.py --toy                            # CPU, tiny (CI)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from dyad.kernels.grouped_mm import grouped_mm
from moe_layer import SHAPES, TOY, expert_flops, median_ms  # beside this script


def swiglu_experts(mm, x_ND, w1, w3, w2):
    return mm(F.silu(mm(x_ND, w1)) * mm(x_ND, w3), w2)


def make_operands(shape, device, dtype):
    dim, hidden, experts, top_k, tokens = shape
    rows = tokens * top_k
    x = torch.randn(rows, dim, device=device, dtype=dtype, requires_grad=True)
    ws = [(torch.randn(experts, *s, device=device, dtype=dtype) * 0.02).requires_grad_(True)
          for s in ((dim, hidden), (dim, hidden), (hidden, dim))]
    return x, ws, torch.randn(rows, dim, device=device, dtype=dtype)


def time_method(method, shape, device, dtype, iters) -> float:
    experts, rows = shape[2], shape[3] * shape[4]
    x, ws, grad = make_operands(shape, device, dtype)
    counts = [rows // experts] * experts
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)

    def grouped(a, w):
        return grouped_mm(a, w, offs)

    def looped(a, w):
        return torch.cat([block @ w[e] for e, block in enumerate(a.split(counts))])

    def dense(a, w):
        return a @ w[0]

    mm = {"grouped": grouped, "looped": looped, "dense": dense}[method]

    def step():
        swiglu_experts(mm, x, *ws).backward(grad)

    return median_ms(step, iters, device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "cpu" if args.toy or not torch.cuda.is_available() else "cuda"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = TOY if device == "cpu" else SHAPES
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "torch": torch.__version__, "shapes": {}}
    print(f"{'shape':13s} {'method':8s} {'ms':>8s} {'TFLOP/s':>8s}")
    for name, shape in shapes.items():
        flops = expert_flops(shape[0], shape[1], shape[4], shape[3])
        entry = results["shapes"][name] = {}
        for method in ("grouped", "looped", "dense"):
            ms = time_method(method, shape, device, dtype, args.iters)
            entry[method] = {"ms": ms, "tflops": flops / ms / 1e9}
            print(f"{name:13s} {method:8s} {ms:8.2f} {flops / ms / 1e9:8.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
