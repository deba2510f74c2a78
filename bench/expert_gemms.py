"""Where an MoE layer's floor lies: its three expert GEMMs forward and backward (SwiGLU between
them) on balanced routing, computed several ways on one GPU, and the pieces around them:

- `grouped`: one `F.grouped_mm` per GEMM over all experts (what dyad's layer runs), the weight
  gradients added into `.grad` as the layer benchmark's layers do (never cleared);
- `grouped-fresh`: the same with `.grad` cleared before each call (gradients written, not added);
- `grouped-into-grad`: `grouped`, the weight gradients added into `.grad` by one cuBLAS GEMM per
  expert (`dyad/kernels/expert_weight_grads.py`, what the layer runs on CUDA with few experts; with
  more than its MAX_EXPERTS this is `grouped`);
- `w13-into-grad`: `grouped-into-grad` with w1 and w3 as one [E, D, 2F] weight: one GEMM for
  both up-projections forward, one input-gradient GEMM over both (no add of two), the gate
  reading the two halves in place and writing both halves' gradients into one buffer (an
  experiment: the layer keeps w1 and w3 apart);
- `grouped-fresh-compiled` / `grouped-fresh-autotuned-compiled`: `grouped-fresh` compiled whole
  by inductor, the GEMMs left to PyTorch's grouped GEMM (CUTLASS), or with max-autotune, which
  times inductor's Triton grouped-GEMM template in every configuration it has against it and
  keeps the fastest for each GEMM (and may fuse the gate into a Triton GEMM's epilogue);
- `looped-fresh`: one cuBLAS `torch.mm` per expert and GEMM, each expert's weights their own
  tensor (no indexing in the graph), `.grad` cleared;
- `dense-fresh`: one `torch.mm` over all rows with one weight of one expert's shape, `.grad`
  cleared: the same FLOPs in the largest GEMMs there are, the floor no layer gets under;
- `swiglu` / `swiglu-fused` / `swiglu-compiled`: SwiGLU's gate alone (silu(h1) * h3, forward
  and backward) on the rows' hidden activations: eager, dyad's Triton kernels
  (`dyad/kernels/swiglu.py`, what the layer runs on CUDA), and compiled by inductor.

    python bench/expert_gemms.py --out $OUT/expert_gemms.json
    python bench/expert_gemms.py --shapes mixtral-like --methods grouped-fresh-compiled,grouped-fresh-autotuned-compiled
    python bench/expert_gemms.py --toy                            # CPU, tiny (CI)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from moe_layer import SHAPES, TOY, expert_flops, median_ms  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script

from dyad.kernels.expert_weight_grads import expert_grouped_mm
from dyad.kernels.grouped_mm import grouped_mm
from dyad.kernels.swiglu import swiglu as fused_swiglu

METHODS = [
    "grouped", "grouped-fresh", "grouped-into-grad", "w13-into-grad",
    "grouped-fresh-compiled", "grouped-fresh-autotuned-compiled",
    "looped-fresh", "dense-fresh", "swiglu", "swiglu-fused", "swiglu-compiled",
]
COMPILE_MODES = {"grouped-fresh-compiled": None, "grouped-fresh-autotuned-compiled": "max-autotune-no-cudagraphs"}


def swiglu(h1, h3):
    return F.silu(h1) * h3


def swiglu_experts(mm, x_ND, w1, w3, w2):
    return mm(swiglu(mm(x_ND, w1), mm(x_ND, w3)), w2)


def grouped_swiglu_experts(x_ND, w1, w3, w2, offs_E):
    """The three expert GEMMs as PyTorch's grouped GEMM, for torch.compile to trace whole."""
    return swiglu_experts(lambda a, w: F.grouped_mm(a, w, offs=offs_E), x_ND, w1, w3, w2)


class _HalvesGate(torch.autograd.Function):
    """silu(h[:, :F]) * h[:, F:] for h = [h1 | h3], with eager SwiGLU's kernels (silu and the
    product forward; two products and silu's backward), the gradient of h written into one buffer."""

    @staticmethod
    def forward(ctx, h13_N2F):
        h1, h3 = h13_N2F.chunk(2, dim=1)
        silu = F.silu(h1)
        ctx.save_for_backward(h13_N2F, silu)
        return silu * h3

    @staticmethod
    def backward(ctx, grad_NF):
        h13_N2F, silu = ctx.saved_tensors
        h1, h3 = h13_N2F.chunk(2, dim=1)
        grad_N2F = torch.empty_like(h13_N2F)
        grad_h1, grad_h3 = grad_N2F.chunk(2, dim=1)
        torch.mul(grad_NF, silu, out=grad_h3)
        torch.ops.aten.silu_backward.grad_input(grad_NF * h3, h1, grad_input=grad_h1)
        return grad_N2F


def _leaf(*shape, device, dtype, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_(True)


def expert_step(method, shape, device, dtype):
    """One forward + backward of the expert GEMMs by `method`, and the tensors whose `.grad`
    it leaves (cleared before each call unless the method accumulates)."""
    dim, hidden, experts, top_k, tokens = shape
    rows = tokens * top_k
    counts = [rows // experts] * experts
    x = _leaf(rows, dim, device=device, dtype=dtype)
    grad = torch.randn(rows, dim, device=device, dtype=dtype)
    shapes = ((dim, hidden), (dim, hidden), (hidden, dim))
    if method in ("grouped", "grouped-fresh", "grouped-into-grad"):
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        ws = [_leaf(experts, *s, device=device, dtype=dtype, scale=0.02) for s in shapes]
        mm = expert_grouped_mm if method == "grouped-into-grad" else grouped_mm
        run = lambda: swiglu_experts(lambda a, w: mm(a, w, offs), x, *ws)  # noqa: E731
        leaves = ws + [x]
    elif method in COMPILE_MODES:
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        ws = [_leaf(experts, *s, device=device, dtype=dtype, scale=0.02) for s in shapes]
        compiled = torch.compile(grouped_swiglu_experts, mode=COMPILE_MODES[method], dynamic=False)
        run = lambda: compiled(x, *ws, offs)  # noqa: E731
        leaves = ws + [x]
    elif method == "w13-into-grad":
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        w13 = _leaf(experts, dim, 2 * hidden, device=device, dtype=dtype, scale=0.02)
        w2 = _leaf(experts, hidden, dim, device=device, dtype=dtype, scale=0.02)
        run = lambda: expert_grouped_mm(  # noqa: E731
            _HalvesGate.apply(expert_grouped_mm(x, w13, offs)), w2, offs)
        leaves = [w13, w2, x]
    elif method == "looped-fresh":
        per_expert = [[_leaf(*s, device=device, dtype=dtype, scale=0.02) for s in shapes] for _ in range(experts)]
        run = lambda: torch.cat(  # noqa: E731
            [swiglu_experts(torch.mm, block, *ws) for block, ws in zip(x.split(counts), per_expert)]
        )
        leaves = [w for ws in per_expert for w in ws] + [x]
    elif method == "dense-fresh":
        ws = [_leaf(*s, device=device, dtype=dtype, scale=0.02) for s in shapes]
        run = lambda: swiglu_experts(torch.mm, x, *ws)  # noqa: E731
        leaves = ws + [x]
    else:
        raise ValueError(f"method {method!r}")
    accumulates = method in ("grouped", "grouped-into-grad", "w13-into-grad")

    def step():
        if not accumulates:
            for leaf in leaves:
                leaf.grad = None
        run().backward(grad)

    return step


def swiglu_step(shape, device, dtype, how: str):
    dim, hidden, experts, top_k, tokens = shape
    rows = tokens * top_k
    h1, h3 = _leaf(rows, hidden, device=device, dtype=dtype), _leaf(rows, hidden, device=device, dtype=dtype)
    grad = torch.randn(rows, hidden, device=device, dtype=dtype)
    fn = torch.compile(swiglu) if how == "swiglu-compiled" else {"swiglu": swiglu, "swiglu-fused": fused_swiglu}[how]

    def step():
        h1.grad = h3.grad = None
        fn(h1, h3).backward(grad)

    return step


def time_method(method, shape, device, dtype, iters) -> float:
    if method.startswith("swiglu"):
        step = swiglu_step(shape, device, dtype, method)
    else:
        step = expert_step(method, shape, device, dtype)
    ms = median_ms(step, iters, device)
    del step
    if device == "cuda":
        torch.cuda.empty_cache()
    return ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out")
    parser.add_argument("--methods", help="comma-separated names from METHODS (default: all)")
    parser.add_argument("--shapes", help="comma-separated names from moe_layer.SHAPES (default: all)")
    args = parser.parse_args()
    device = bench_device(args.toy)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = TOY if device == "cpu" else SHAPES
    if args.shapes and device == "cuda":
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    methods = args.methods.split(",") if args.methods else METHODS
    methods = [m for m in methods if device == "cuda" or not m.endswith("compiled")]  # Triton: GPUs
    results = {**run_header(device), "shapes": {}}
    print(f"{'shape':13s} {'method':18s} {'ms':>8s} {'TFLOP/s':>8s}")
    for name, shape in shapes.items():
        flops = expert_flops(shape[0], shape[1], shape[4], shape[3])
        entry = results["shapes"][name] = {}
        for method in methods:
            ms = time_method(method, shape, device, dtype, args.iters)
            entry[method] = {"ms": ms}
            rate = ""
            if not method.startswith("swiglu"):
                entry[method]["tflops"] = flops / ms / 1e9
                rate = f"{flops / ms / 1e9:8.1f}"
            print(f"{name:13s} {method:18s} {ms:8.2f} {rate}", flush=True)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
