"""Are the LLM's gradients with compiled blocks (`train.compile`) as close to float32 as eager
bf16's? One forward and backward of a small MoE LLM (a dense first block, then MoE blocks) in
bf16 autocast, eager and under several compile variants, each against the same model's float32
eager gradients: the worst and the median relative error over the parameter gradients, and the
parameters that are furthest off.

Found on an H200 (torch 2.11): with every block compiled by inductor the gradients are 10-50 %
off while eager bf16 is 1.2 % off; with one block compiled, with the MoE layers left out of the
compiled graphs, or under torch.use_deterministic_algorithms they were as close as eager's in
single runs, by chance (docs/performance.md, "Compiled bf16 gradients on a GPU"). The cause: a
fused looped-reduction kernel of the MoE block's backward loads back a buffer it stored, and its
threads do not all see the stores; `dyad-compile` is train.compile's path, with the barrier
dyad/inductor_reloads.py adds.

    python bench/compiled_gradients.py --out $OUT/compiled_gradients.json   # on a GPU host
    python bench/compiled_gradients.py --toy                                # CPU, tiny (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS under deterministic algorithms

import torch
from run_info import bench_device, run_header, write_json  # beside this script

from dyad import config as config_lib
from dyad.compile import compile_blocks
from dyad.data import make_dataset
from dyad.llm_service.moe import MoELayer
from dyad.service import build_model

MODEL = ["llm.dim=256", "llm.n_heads=4", "llm.n_kv_heads=2", "llm.moe.expert_dim=128", "llm.moe.shared_expert_dim=32"]
SIZES = {"gpu": dict(batch=8, seq=256, image_rows=64), "toy": dict(batch=2, seq=24, image_rows=6)}
VARIANTS = ["eager", "first-block", "last-block", "all-blocks", "all-blocks-again", "all-blocks-first-pass",
            "all-blocks-poisoned", "all-blocks-zeroed", "moe-eager", "deterministic", "aot-eager",
            "dyad-compile", "dyad-compile-again"]
# dyad's compile_blocks patches inductor for the rest of the process (dyad/inductor_reloads.py):
# its variants run after the plain ones, whatever order --variants names them in.
PATCHING = ("dyad-compile", "dyad-compile-again")


def build(device: str, size: dict):
    config = config_lib.load(None, MODEL)
    config = config_lib.resolve(config, vocab_size=make_dataset(config.data).tokenizer.vocab_size)
    torch.manual_seed(0)
    model = build_model(config, "llm", device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(config.llm.vocab_size, (size["batch"], size["seq"]), generator=generator).to(device)
    rows = torch.randn(size["image_rows"], config.llm.dim, generator=generator).to(device)
    return model, (ids, rows, torch.arange(size["image_rows"], device=device))


def gradients(model, inputs, bf16: bool, passes: int = 2) -> dict[str, torch.Tensor]:
    """The last of `passes` forward and backward passes (the first compiles)."""
    ids, rows, positions = inputs
    for _ in range(passes):
        model.zero_grad(set_to_none=True)
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits, aux = model(ids, rows, positions)
            loss = model.loss_sum(logits, ids.roll(-1, dims=1)) / ids.numel() + aux
        loss.backward()
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def free_memory_filled(value: float):
    """Leave `value` in the CUDA caching allocator's free blocks, small and large: with NaN, a
    kernel that reads memory nobody wrote makes non-finite gradients; with zeros, such a read
    would go unseen."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        small = [torch.full((256,), value, device="cuda") for _ in range(20000)]  # the small-block pool
        large = [torch.full((2**28,), value, device="cuda") for _ in range(8)]  # 8 GiB of large blocks
        torch.cuda.synchronize()
        del small, large
    yield


@contextlib.contextmanager
def moe_layers_eager():
    forward = MoELayer.forward
    MoELayer.forward = torch.compiler.disable(forward)
    try:
        yield
    finally:
        MoELayer.forward = forward


@contextlib.contextmanager
def deterministic_algorithms():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def variant_gradients(name: str, base, inputs, backend: str) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(base)
    if name in PATCHING:  # train.compile's path: every block, with the barrier before reloads
        compile_blocks(model, backend)
        grads = gradients(model, inputs, bf16=True)
        torch._dynamo.reset()
        return grads
    blocks = {"first-block": model.layers[:1], "last-block": model.layers[-1:]}.get(name, model.layers)
    if name != "eager":
        for block in blocks:
            block.compile(backend="aot_eager" if name == "aot-eager" else backend)
    contexts = {"moe-eager": moe_layers_eager, "deterministic": deterministic_algorithms,
                "all-blocks-poisoned": functools.partial(free_memory_filled, float("nan")),
                "all-blocks-zeroed": functools.partial(free_memory_filled, 0.0)}
    with contexts.get(name, contextlib.nullcontext)():
        grads = gradients(model, inputs, bf16=True, passes=1 if name == "all-blocks-first-pass" else 2)
    torch._dynamo.reset()
    return grads


def relative_errors(got: dict, truth: dict) -> dict[str, float]:
    return {n: ((got[n] - truth[n]).norm() / truth[n].norm().clamp_min(1e-12)).item() for n in truth}


def summary(errors: dict[str, float]) -> dict:
    ordered = sorted(errors.items(), key=lambda item: -item[1])
    values = sorted(errors.values())
    non_finite = [name for name, error in errors.items() if not math.isfinite(error)]
    return {"worst": ordered[0][1], "median": values[len(values) // 2], "furthest": dict(ordered[:4]),
            "non_finite": non_finite}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy", action="store_true", help="tiny sizes on CPU, aot_eager for inductor (CI)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    variants = sorted(args.variants.split(","), key=lambda name: name in PATCHING)
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    device = bench_device(args.toy)
    backend = "aot_eager" if args.toy else "inductor"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    base, inputs = build(device, SIZES["toy" if args.toy else "gpu"])
    truth = gradients(copy.deepcopy(base), inputs, bf16=False)
    results = {**run_header(device), "backend": backend, "model": MODEL, "variants": {}}
    print(f"{'variant':22s} {'worst':>9s} {'median':>9s}  furthest off")
    for name in variants:
        row = summary(relative_errors(variant_gradients(name, base, inputs, backend), truth))
        results["variants"][name] = row
        furthest = " ".join(f"{n}={e:.1e}" for n, e in list(row["furthest"].items())[:3])
        nan = f"  non-finite: {len(row['non_finite'])}" if row["non_finite"] else ""
        print(f"{name:22s} {row['worst']:9.2e} {row['median']:9.2e}  {furthest}{nan}", flush=True)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
