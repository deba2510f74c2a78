"""The MoE router's kernels (`dyad/kernels/moe_router.py`) against their plain-PyTorch references, on
one GPU: the logits forward, its backward (input and weight gradients), and the softmax top-k,
for the MoE layer benchmark's shapes, with bf16 activations and a bf16 or float32 router weight
(float32: a master weight under autocast). On a GPU each row is the kernels' own time (summed
from a profile: these steps are small enough that a timer around them measures the host's
launches, which the layer benchmark shows in context) and the bytes the kernels must move over
the device's copy bandwidth, measured in the same run.

    python bench/router_kernels.py --out $OUT/router_kernels.json     # on a GPU host
    python bench/router_kernels.py --toy                               # CPU, references only (CI)
    python bench/router_kernels.py --sweep --out $OUT/sweep.json      # GPU: launch sizes

`--sweep` times each of the three logits kernels alone (`fused_logits`, `fused_input_grad`,
`fused_weight_grad`) under each candidate launch (`SWEEP`), checks each result against float32
math, and prints the fastest that agree: how `_LAUNCHES` in `dyad/kernels/moe_router.py` was chosen.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from kernel_timeline import kernel_ms  # beside this script
from moe_layer import SHAPES, TOY, time_interleaved
from run_info import bench_device, write_json  # beside this script

from dyad.kernels import moe_router


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


SWEEP = {  # (block_t, block_d, warps, stages[, splits]) candidates
    "logits": list(itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))),
    "input_grad": list(itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3))),
    "weight_grad": [(t, d, w, 3, splits) for t, d, w, splits in itertools.product((64, 128), (64, 128), (4, 8), (8, 16, 32))],
}


def sweep_cases(shape, weight_dtype):
    """{kernel: (call, its result in float32 math)} for one shape and router weight dtype."""
    dim, _, experts, _, tokens = shape
    x_TD = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    w_ED = (torch.randn(experts, dim, device="cuda") * 0.02).to(weight_dtype)
    grad_TE = torch.randn(tokens, experts, device="cuda")
    return {
        "logits": (lambda: moe_router.fused_logits(x_TD, w_ED), x_TD.float() @ w_ED.float().T),
        "input_grad": (lambda: moe_router.fused_input_grad(grad_TE, x_TD, w_ED), grad_TE @ w_ED.float()),
        "weight_grad": (lambda: moe_router.fused_weight_grad(grad_TE, x_TD, w_ED), grad_TE.T @ x_TD.float()),
    }


def agreement(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Relative distance from float32 math rounded to got's dtype (0: every element alike)."""
    expected = exact.to(got.dtype)
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def run_sweep(shapes, rep_ms: int) -> list[dict]:
    import triton.testing

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references stay float32
    rows = []
    for name, shape in shapes.items():
        for weight_dtype in (torch.bfloat16, torch.float32):
            cases = sweep_cases(shape, weight_dtype)
            kernels = cases if weight_dtype == torch.bfloat16 else ("logits", "input_grad")  # weight_grad reads x alone
            for kernel in kernels:
                call, exact = cases[kernel]
                keys = [key for key in moe_router._LAUNCHES if key.split("/")[0] == kernel]
                saved = {key: moe_router._LAUNCHES[key] for key in keys}
                for candidate in SWEEP[kernel]:
                    launch = moe_router._Launch(*candidate)
                    moe_router._LAUNCHES.update({key: [(1 << 30, launch)] for key in keys})
                    row = {"shape": name, "weight": str(weight_dtype), "kernel": kernel, "launch": launch._asdict()}
                    try:
                        row["error"] = agreement(call(), exact)
                        row["us"] = triton.testing.do_bench(call, warmup=25, rep=rep_ms, return_mode="median") * 1e3
                    except Exception as e:  # e.g. a launch needing more shared memory than there is
                        row["failed"] = repr(e)[:200]
                    rows.append(row)
                moe_router._LAUNCHES.update(saved)
                _print_best(rows, name, shape[2], weight_dtype, kernel)
    return rows


def _print_best(rows, name, experts, weight_dtype, kernel) -> None:
    mine = [r for r in rows if r["shape"] == name and r["weight"] == str(weight_dtype) and r["kernel"] == kernel]
    timed = sorted((r for r in mine if "us" in r), key=lambda r: r["us"])
    key = moe_router.input_grad_launch_key(weight_dtype) if kernel == "input_grad" else kernel
    current = moe_router._launch(key, moe_router._experts_padded(experts))
    now = next((r["us"] for r in timed if r["launch"] == current._asdict()), float("nan"))
    for r in timed[:3]:
        print(f"{name:13s} {str(weight_dtype)[6:]:9s} {kernel:12s} {r['us']:8.1f} µs (now {now:.1f}) "
              f"error {r['error']:.1e} {tuple(r['launch'].values())}", flush=True)
    failed = [r for r in mine if "failed" in r]
    if failed:
        print(f"  {len(failed)} launches failed, e.g. {failed[0]['failed']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true", help="tiny shape on CPU (keeps the script working)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", help="write results as JSON here")
    parser.add_argument("--sweep", action="store_true", help="time each logits kernel under each candidate launch")
    args = parser.parse_args()
    device = bench_device(args.toy)
    if args.sweep:
        if device == "cpu":
            raise SystemExit("--sweep: needs a CUDA device with Triton")
        results = {"device": torch.cuda.get_device_name(), "rows": run_sweep(SHAPES, rep_ms=100)}
        write_json(args.out, results)
        return
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
    write_json(args.out, results)


if __name__ == "__main__":
    main()
