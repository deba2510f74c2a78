"""MoE layer forward+backward on one GPU: dyad's `MoELayer` (bf16, with float8 expert GEMMs, and with w1|w3
interleaved so that SwiGLU runs in QuACK's GEMM epilogues, `dyad-gate-up-interleaved`, and the same with QuACK's
autotuner picking the tiles, `dyad-gate-up-autotuned`) beside torchtitan 0.3.0's MoE module
and Hugging Face transformers' Qwen3-MoE sparse block, same shapes, same run, bf16.

    python bench/moe_layer.py --out $OUT/moe_layer.json          # on a GPU host
    python bench/moe_layer.py --interleave --head-start --layers dyad,torchtitan-0.3.0   # in turn, also host ahead
    python bench/moe_layer.py --toy                             # CPU, tiny shape (CI)

`dyad` is the layer with w1 and w3 as two weights (`TwoWeightsLayer`, the layout before
2026-11-29, once `llm.moe.gate_up: separate`), the name kept so that earlier results compare; the
LLM service's layer is `dyad-gate-up-interleaved` (one interleaved weight).

Also times the grouped-matmul ceiling of each shape (the three expert GEMMs forward and backward
on perfectly balanced routing, nothing else) and reports each layer's share of it. Peers that
are not installed are reported as such. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F
from kernel_timeline import write_timeline  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script
from torch import nn

from dyad import inductor_reloads
from dyad.kernels import expert_weight_grads
from dyad.kernels.fp8 import forget_quantized, fp8_grouped_mm
from dyad.kernels.gated_experts import gated_experts
from dyad.kernels.grouped_mm import grouped_mm
from dyad.kernels.moe_router import router_logits_reference
from dyad.kernels.swiglu import swiglu
from dyad.llm_service.config import MoEConfig
from dyad.llm_service.moe import GroupedSwiGLU, MoELayer

SHAPES = {  # name: (dim, expert hidden, experts, top-k, tokens)
    "qwen3-like": (2048, 768, 128, 8, 16384),
    "mixtral-like": (4096, 14336, 8, 2, 8192),
}
TOY = {"toy": (64, 32, 8, 2, 256)}


def elapsed_ms(fn, device: str, head_start: bool = False) -> float:
    """One call of `fn`, timed with CUDA events from an idle GPU (host clock on CPU). With
    `head_start`, two large matmuls are queued before the start event: the host launches `fn`'s
    first kernels while the GPU is still busy, as it does inside a model whose earlier layers'
    kernels are queued, so the time is the GPU's and not the host's launches."""
    if device != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    if head_start:
        _queue_busy_work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


@functools.cache
def _busy_operand() -> torch.Tensor:
    return torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)


def _queue_busy_work(matmuls: int = 2) -> None:
    a = _busy_operand()
    for _ in range(matmuls):  # about 1.5 ms each on an H100
        torch.mm(a, a)


def median_ms(fn, iters: int, device: str) -> float:
    return time_interleaved({"": fn}, iters, device)[""]


def time_interleaved(fns: dict, iters: int, device: str, head_start: bool = False) -> dict:
    """Median ms of each function, called in turn (a, b, c, a, b, c, ...) so that the GPU's
    clock and temperature drift over the run falls on all of them alike."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            times[name].append(elapsed_ms(fn, device, head_start))
    return {name: statistics.median(t) for name, t in times.items()}


def expert_flops(dim, hidden, tokens, top_k) -> float:
    """Forward + backward of the three expert GEMMs (w1, w3, w2): 3 passes x 3 GEMMs x 2 flops."""
    return 3 * 3 * 2 * tokens * top_k * dim * hidden


class TwoWeightsLayer(MoELayer):
    """dyad's layer with w1 and w3 as two weights, each up-projection its own grouped GEMM
    (`expert_matmul`; float8's for `dyad-fp8`): the A/B baseline of the one interleaved weight."""

    def __init__(self, dim, cfg, expert_matmul=expert_weight_grads.expert_grouped_mm):
        super().__init__(dim, cfg)
        del self.w13_ED2F
        self.w1_EDF = nn.Parameter(torch.empty(cfg.num_experts, dim, cfg.expert_dim).normal_(std=0.02))
        self.w3_EDF = nn.Parameter(torch.empty(cfg.num_experts, dim, cfg.expert_dim).normal_(std=0.02))
        self.expert_matmul = expert_matmul

    def experts(self, x_sorted_ND, counts_E):
        offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        h1_NF = self.expert_matmul(x_sorted_ND, self.w1_EDF, offs_E)
        h3_NF = self.expert_matmul(x_sorted_ND, self.w3_EDF, offs_E)
        return self.expert_matmul(swiglu(h1_NF, h3_NF), self.w2_EFD, offs_E)


def dyad_layer(dim, hidden, experts, top_k, layer_type=TwoWeightsLayer):
    cfg = MoEConfig(num_experts=experts, top_k=top_k, expert_dim=hidden, aux_loss_coef=0.01)
    return layer_type(dim, cfg)


def dyad_interleaved_layer(dim, hidden, experts, top_k):
    """w1 and w3 as one interleaved weight: SwiGLU in QuACK's GEMM epilogues where it is installed."""
    return dyad_layer(dim, hidden, experts, top_k, MoELayer)


class AutotunedGroupedSwiGLU(GroupedSwiGLU):
    """The interleaved layer's experts with QuACK's autotuner choosing the fused GEMMs' tiles on the
    first (warm-up) calls instead of its default configuration, for A/B runs. bf16 experts only."""

    def forward(self, x_sorted_ND, w13_ED2F, w2_EFD, offs_E):
        matmul = expert_weight_grads.expert_grouped_mm
        return gated_experts(x_sorted_ND, w13_ED2F, w2_EFD, offs_E, matmul, autotune=True)


def dyad_interleaved_autotuned_layer(dim, hidden, experts, top_k):
    layer = dyad_interleaved_layer(dim, hidden, experts, top_k)
    layer.grouped_swiglu = AutotunedGroupedSwiGLU()
    return layer


class ReferenceRouterLayer(TwoWeightsLayer):
    """dyad's layer with the router's plain-PyTorch references (float32 copies, softmax, sort,
    gather): the path before `dyad/kernels/moe_router.py`, for A/B runs. Default router options only."""

    def router_logits(self, x_TD):
        return router_logits_reference(x_TD, self.router.weight)

    def route(self, x_TD, valid_T=None):
        return self._select(self.router_logits(x_TD))


def dyad_reference_router_layer(dim, hidden, experts, top_k):
    return dyad_layer(dim, hidden, experts, top_k, ReferenceRouterLayer)


def dyad_fp8_layer(dim, hidden, experts, top_k):
    return dyad_layer(dim, hidden, experts, top_k, functools.partial(TwoWeightsLayer, expert_matmul=fp8_grouped_mm))


def dyad_fp8_compiled_layer(dim, hidden, experts, top_k):
    from dyad.kernels import fp8

    fp8.compile_quantization()
    return dyad_fp8_layer(dim, hidden, experts, top_k)


def keeping_weight_codes(make):
    """The float8 layer `make` builds, its weight codes kept from call to call: the cost of one
    microbatch when many share an optimizer step (weights quantized once per step, not per call)."""

    def make_keeping(dim, hidden, experts, top_k):
        layer = make(dim, hidden, experts, top_k)
        layer.bench_keeps_weight_codes = True
        return layer

    return make_keeping


def joining_weight_grads_at_once(make):
    """The layer `make` builds, the current stream waiting for each weight's gradient GEMMs as
    soon as they are queued instead of when the backward pass ends (for A/B runs)."""

    def make_joining(dim, hidden, experts, top_k):
        layer = make(dim, hidden, experts, top_k)
        layer.bench_joins_weight_grads_at_once = True
        return layer

    return make_joining


def weight_grads_on_streams(make, streams: int):
    """The layer `make` builds, its per-expert weight-gradient GEMMs queued on `streams` side
    streams (1), or on the current stream (0), instead of two side streams (for A/B runs)."""

    def make_on_streams(dim, hidden, experts, top_k):
        layer = make(dim, hidden, experts, top_k)
        layer.bench_weight_grad_streams = streams
        return layer

    return make_on_streams


def titan_layer(dim, hidden, experts, top_k):
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    init = {"weight": lambda t: nn.init.normal_(t, std=0.02)}
    cfg = make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init=init, top_k=top_k,
                                  score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(dim=dim, hidden_dim=hidden, num_experts=experts,
                                                  top_k=top_k, param_init=init,
                                                  comm_backend="standard"),
    )
    return cfg.build()


def hf_layer(dim, hidden, experts, top_k):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=dim, moe_intermediate_size=hidden, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    return Qwen3MoeSparseMoeBlock(config)


def compiled(make):
    """The layer `make` builds, compiled whole with torch.compile (inductor), as train.compile
    compiles each block (with its barrier before reloads, dyad/inductor_reloads.py) and
    torchtitan's --compile each of its blocks."""

    def make_compiled(dim, hidden, experts, top_k):
        layer = make(dim, hidden, experts, top_k)
        inductor_reloads.install()
        layer.compile()
        return layer

    return make_compiled


LAYERS = {
    "dyad": dyad_layer,
    "dyad-compiled": compiled(dyad_layer),
    "dyad-gate-up-interleaved": dyad_interleaved_layer,
    "dyad-gate-up-autotuned": dyad_interleaved_autotuned_layer,
    "dyad-reference-router": dyad_reference_router_layer,
    "dyad-wgrads-joined-at-once": joining_weight_grads_at_once(dyad_layer),
    "dyad-wgrads-one-side-stream": weight_grads_on_streams(dyad_layer, 1),
    "dyad-wgrads-current-stream": weight_grads_on_streams(dyad_layer, 0),
    "dyad-fp8": dyad_fp8_layer,
    "dyad-fp8-compiled": dyad_fp8_compiled_layer,
    "dyad-fp8-codes-kept": keeping_weight_codes(dyad_fp8_layer),
    "dyad-fp8-compiled-codes-kept": keeping_weight_codes(dyad_fp8_compiled_layer),
    "torchtitan-0.3.0": titan_layer,
    "torchtitan-0.3.0-compiled": compiled(titan_layer),
    "hf-grouped_mm": hf_layer,
}


def layer_step(make, shape, device, dtype):
    """One forward + backward of the layer `make` builds, as a function of no arguments."""
    dim, hidden, experts, top_k, tokens = shape
    layer = make(dim, hidden, experts, top_k).to(device, dtype)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, dim, device=device, dtype=dtype)
    is_dyad = isinstance(layer, MoELayer)
    requantize = not getattr(layer, "bench_keeps_weight_codes", False)
    joins_at_once = getattr(layer, "bench_joins_weight_grads_at_once", False)
    grad_streams = getattr(layer, "bench_weight_grad_streams", None)

    def step():
        if is_dyad:
            if requantize:  # each call quantizes its weights once, as after an optimizer step
                forget_quantized(layer)
            y, aux = layer(x)
            with _joining_weight_grads_at_once(joins_at_once), _weight_grads_on(grad_streams):
                torch.autograd.backward([y, aux], [grad, torch.ones_like(aux)])
        else:
            out = layer(x.unsqueeze(0))
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad.view_as(out))

    return step


@contextlib.contextmanager
def _weight_grads_on(streams: int | None):
    if streams is None:
        yield
        return
    two_sides = expert_weight_grads._side_streams_after_current

    def fewer(device):
        return two_sides(device)[:streams] if streams else [torch.cuda.current_stream(device)]

    expert_weight_grads._side_streams_after_current = fewer
    try:
        yield
    finally:
        expert_weight_grads._side_streams_after_current = two_sides


@contextlib.contextmanager
def _joining_weight_grads_at_once(enabled: bool):
    if not enabled:
        yield
        return
    join_later = expert_weight_grads.join_when_backward_ends
    expert_weight_grads.join_when_backward_ends = lambda join: join()
    try:
        yield
    finally:
        expert_weight_grads.join_when_backward_ends = join_later


def profile_dyad(shape, device, dtype, path) -> None:
    """Where dyad's layer spends its time: the top CUDA kernels of a few steps, as a table."""
    dim, hidden, experts, top_k, tokens = shape
    layer = dyad_layer(dim, hidden, experts, top_k).to(device, dtype)
    x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, dim, device=device, dtype=dtype)

    def step():
        y, aux = layer(x)
        torch.autograd.backward([y, aux], [grad, torch.ones_like(aux)])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    write_kernel_table(step, path, steps=5, rows=30)


def write_kernel_table(step, path: str, *, steps: int, rows: int) -> None:
    """Profile `steps` calls of `step` and write the top `rows` ops by CUDA time to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows))


def time_ceiling(shape, device, dtype, iters) -> float:
    """The three expert GEMMs, forward and backward, on balanced routing."""
    dim, hidden, experts, top_k, tokens = shape
    rows = tokens * top_k
    offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (rows // experts)
    x = torch.randn(rows, dim, device=device, dtype=dtype, requires_grad=True)
    ws = [torch.randn(experts, *s, device=device, dtype=dtype, requires_grad=True) * 0.02
          for s in ((dim, hidden), (dim, hidden), (hidden, dim))]
    ws = [w.detach().requires_grad_(True) for w in ws]
    grad = torch.randn(rows, dim, device=device, dtype=dtype)

    def step():
        h = F.silu(grouped_mm(x, ws[0], offs)) * grouped_mm(x, ws[1], offs)
        grouped_mm(h, ws[2], offs).backward(grad)

    return median_ms(step, iters, device)


def report(shape_name, layer_name, entry, flops, ceiling_ms, step, timeline_dir) -> None:
    """Print a layer's line; add its expert TFLOP/s (and, on a GPU, its kernel timeline) to `entry`."""
    ms = entry[layer_name]["ms"]
    entry[layer_name]["expert_tflops"] = flops / ms / 1e9
    print(f"{shape_name:13s} {layer_name:18s} {ms:8.2f} {flops / ms / 1e9:15.1f} {ceiling_ms / ms:11.2f}")
    if timeline_dir and torch.cuda.is_available():
        path = f"{timeline_dir}/timeline_{shape_name}_{layer_name}.txt"
        entry[layer_name]["timeline"] = write_timeline(step, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true", help="tiny shape on CPU (keeps the script working)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", help="write results as JSON here")
    parser.add_argument("--profile-dir", help="GPU: write a kernel table of dyad's layer per shape here")
    parser.add_argument("--layers", help="comma-separated names from LAYERS (default: all)")
    parser.add_argument("--shapes", help="comma-separated names from SHAPES (default: all)")
    parser.add_argument("--interleave", action="store_true",
                        help="build every layer first, then time their steps in turn (needs memory for all)")
    parser.add_argument("--head-start", action="store_true",
                        help="with --interleave: also time each step with the GPU busy when it starts")
    parser.add_argument("--timeline-dir", help="GPU: write each layer's kernels in order, with the idle gaps, here")
    args = parser.parse_args()
    layers = {name: LAYERS[name] for name in args.layers.split(",")} if args.layers else LAYERS
    device = bench_device(args.toy)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = TOY if device == "cpu" else SHAPES
    if args.shapes and device == "cuda":
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    results = {**run_header(device), "dtype": str(dtype), "shapes": {}}
    print(f"{'shape':13s} {'layer':18s} {'ms':>8s} {'expert TFLOP/s':>15s} {'of ceiling':>11s}")
    for name, shape in shapes.items():
        flops = expert_flops(shape[0], shape[1], shape[4], shape[3])
        entry = {"shape": dict(zip(("dim", "hidden", "experts", "top_k", "tokens"), shape))}
        ceiling_ms = time_ceiling(shape, device, dtype, args.iters)
        entry["grouped_mm_ceiling_ms"] = ceiling_ms
        print(f"{name:13s} {'grouped_mm ceiling':18s} {ceiling_ms:8.2f} {flops / ceiling_ms / 1e9:15.1f} {'1.00':>11s}")
        steps = {}
        for layer_name, make in layers.items():
            if layer_name.endswith("compiled") and device == "cpu":
                continue  # compiled layers and quantization are for GPUs (Triton); CI's toy run stays eager
            try:
                steps[layer_name] = layer_step(make, shape, device, dtype)
                if not args.interleave:
                    entry[layer_name] = {"ms": median_ms(steps[layer_name], args.iters, device)}
                    report(name, layer_name, entry, flops, ceiling_ms, steps.pop(layer_name), args.timeline_dir)
            except ImportError as error:
                entry[layer_name] = {"error": f"not installed: {error}"}
                print(f"{name:13s} {layer_name:18s} not installed ({error})")
            except RuntimeError as error:  # one layer failing must not lose the others' numbers
                entry[layer_name] = {"error": str(error)[:2000]}
                print(f"{name:13s} {layer_name:18s} failed: {str(error)[:300]}")
        for layer_name, ms in time_interleaved(steps, args.iters, device).items() if steps else ():
            entry[layer_name] = {"ms": ms}
            report(name, layer_name, entry, flops, ceiling_ms, steps[layer_name], args.timeline_dir)
        if args.head_start and device == "cuda" and steps:
            for layer_name, ms in time_interleaved(steps, args.iters, device, head_start=True).items():
                entry[layer_name]["ms_host_ahead"] = ms
                print(f"{name:13s} {layer_name:18s} {ms:8.2f} ms with the host ahead (--head-start)")
        del steps
        if device == "cuda":
            torch.cuda.empty_cache()
        results["shapes"][name] = entry
        if args.profile_dir and device == "cuda":
            profile_dyad(shape, device, dtype, f"{args.profile_dir}/moe_profile_{name}.txt")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
