"""The MoE router's kernels (`kernels/moe_router.py`) against their plain-PyTorch references, on
one GPU: the logits forward, its backward (input and weight gradients), and the softmax top-k,
for the MoE layer benchmark's shapes, with bf16 activations and a bf16 or float32 router weight
(float32: a master weight under autocast). On a GPU each row is the kernels' own time (summed
from a profile: these steps are small enough that a timer around them measures the host's
launches, which the layer benchmark shows in context) and the bytes the kernels must move over
the device's copy bandwidth, measured in the same run.

    python bench/router_kernels.py --out $OUT/router_kernels.json     # on a GPU host
    python bench/router_kernels.py --toy                               # CPU, references only (CI)
"""

from __future__ import annotations

import argparse
import json

import torch

from dyad.kernels import moe_router
from kernel_timeline import kernel_ms  # beside this script
from moe_layer import SHAPES, TOY, time_interleaved


def router_steps(shape, device, weight_dtype):
    """{name: step} for the fused path and the reference, forward alone and forward + backward."""
    dim, _, experts, top_k, tokens = shape
    act = torch.bfloat16 if device == "cuda" else torch.float32
    x_TD = torch.randn(tokens, dim, device=device, dtype=act, requires_grad=True)
    w_ED = (torch.randn(experts, dim, device=device) * 0.02).to(weight_dtype).requires_grad_(True)
    grad_TE = torch.randn(tokens, experts, device=device)
    logits_TE = torch.randn(tokens, experts, device=device)
    steps = {}
    for who, logits_fn, topk_fn in (
        ("fused", moe_router.router_logits, moe_router.softmax_topk),
        ("reference", moe_router.router_logits_reference, moe_router.softmax_topk_reference),
    ):
        steps[f"logits forward, {who}"] = lambda fn=logits_fn: fn(x_TD.detach(), w_ED.detach())
        steps[f"logits forward+backward, {who}"] = lambda fn=logits_fn: fn(x_TD, w_ED).backward(grad_TE)
        steps[f"softmax top-k, {who}"] = lambda fn=topk_fn: fn(logits_TE, top_k)
    return steps


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = time_interleaved({"copy": lambda: dst.copy_(src)}, 20, device)["copy"]
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def floor_us(shape, weight_dtype, step_name, bandwidth) -> float:
    """The bytes a kernel must move over the copy bandwidth: x once per pass over it."""
    dim, _, experts, _, tokens = shape
    x_bytes = tokens * dim * 2
    passes = 1 if "forward," in step_name else 3  # + the input gradient's write, the weight gradient's read
    if "top-k" in step_name:
        return tokens * experts * 4 * 2 / bandwidth * 1e6
    return passes * x_bytes / bandwidth * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true", help="tiny shape on CPU (keeps the script working)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", help="write results as JSON here")
    args = parser.parse_args()
    device = "cpu" if args.toy or not torch.cuda.is_available() else "cuda"
    shapes = TOY if device == "cpu" else SHAPES
    bandwidth = copy_bandwidth(device) if device == "cuda" else float("nan")
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "copy_bandwidth_GBps": bandwidth / 1e9, "rows": []}
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'shape':13s} {'weight':9s} {'step':38s} {'µs':>9s} {'floor µs':>9s}")
    for name, shape in shapes.items():
        for weight_dtype in (torch.bfloat16, torch.float32):
            steps = router_steps(shape, device, weight_dtype)
            if device == "cuda":
                timed = {step_name: kernel_ms(step, args.iters) for step_name, step in steps.items()}
            else:
                timed = time_interleaved(steps, args.iters, device)
            for step_name, ms in timed.items():
                floor = floor_us(shape, weight_dtype, step_name, bandwidth)
                results["rows"].append({"shape": name, "weight": str(weight_dtype), "step": step_name,
                                        "us": ms * 1e3, "floor_us": floor})
                print(f"{name:13s} {str(weight_dtype)[6:]:9s} {step_name:38s} {ms * 1e3:9.1f} {floor:9.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
