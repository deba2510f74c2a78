# The scratch script behind exploration/*.json (one H100, quack-kernels 0.6.5 with cutlass-dsl
# 4.8.1 installed under /tmp/site). Its `_with_context_vars` shim worked around QuACK's kernel-cache
# keying, which recurses into any function installed outside a "site-packages" folder; installed
# under .../site-packages (as pip installs) no shim is needed. Kept for provenance, not maintained.
"""Scratch: QuACK's fused SwiGLU grouped GEMMs against dyad's experts, Mixtral-like shape, one GPU.

Variants (forward + backward of the expert block on pre-permuted rows, weight gradients
accumulated into .grad like the layer):
  dyad        MoELayer.experts: CUTLASS grouped GEMMs (torch._grouped_mm), dyad's fused gate,
              per-expert cuBLAS weight-gradient GEMMs on two side streams
  quack-fused gemm_gated (gate in the up-projection's epilogue, w1|w3 interleaved in one
              [E, D, 2F] weight), gemm_dgated (gate's backward in the down-projection's
              input-gradient epilogue), varlen-K weight-gradient GEMMs accumulating in place
  quack-plain QuACK's plain grouped GEMMs for all nine products, dyad's gate kernel
"""

import json
import os
import statistics
import sys
import traceback

import torch

OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
T, K, E, D, FF = 8192, 2, 8, 4096, 14336
if os.environ.get("TOY"):
    T, E, D, FF = 512, 4, 256, 512
N = T * K
ITERS = int(os.environ.get("ITERS", "40"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
CFG = os.environ.get("CFG", "")  # e.g. "128,192,2,1,1" tile_m,tile_n,cluster_m,cluster_n,pingpong

import contextvars  # noqa: E402

import quack.gemm_runtime.identity as _identity  # noqa: E402

_semantic_value_key = _identity.semantic_value_key


def _with_context_vars(value, seen):
    # quack 0.6.5 under cutlass-dsl 4.8.1: the DSL's loc-transform ContextVar has no key
    if isinstance(value, contextvars.ContextVar):
        return ("contextvar", value.name)
    try:
        return _semantic_value_key(value, seen)
    except TypeError:  # DSL internals (descriptors, ...): the same for every kernel of this run
        return ("opaque", type(value).__module__, type(value).__qualname__, getattr(value, "__name__", None))


_identity.semantic_value_key = _with_context_vars

from quack.gemm_config import GemmConfig  # noqa: E402
from quack.gemm_interface import gemm, gemm_act, gemm_add_inplace, gemm_dact  # noqa: E402

from bench.moe_layer import dyad_layer  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dyad.kernels.expert_weight_grads import _side_streams_after_current, add_weight_grads  # noqa: E402
from dyad.kernels.swiglu import swiglu  # noqa: E402


def config():
    if not CFG:
        return None
    tm, tn, cm, cn, pp = (int(v) for v in CFG.split(","))
    return GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=bool(pp), is_dynamic_persistent=False)


def kw():
    c = config()
    return {"tuned": False, "config": c} if c is not None else {"tuned": False}


class FusedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w13_ED2F, w2_EFD, cu_E1):
        preact_N2F, g_NF = gemm_act(x_ND, w13_ED2F, activation="swiglu", cu_seqlens_m=cu_E1, **kw())
        y_ND = gemm(g_NF, w2_EFD, cu_seqlens_m=cu_E1, tuned=False)
        ctx.save_for_backward(x_ND, preact_N2F, w13_ED2F, w2_EFD, cu_E1)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, preact_N2F, w13_ED2F, w2_EFD, cu_E1 = ctx.saved_tensors
        dy_ND = dy_ND.contiguous()
        dpre_N2F, g_NF = gemm_dact(dy_ND, w2_EFD.mT, preact_N2F, activation="swiglu", cu_seqlens_m=cu_E1, tuned=False)
        gemm_add_inplace(g_NF.T, dy_ND, w2_EFD.grad, cu_seqlens_k=cu_E1, tuned=False)
        dx_ND = gemm(dpre_N2F, w13_ED2F.mT, cu_seqlens_m=cu_E1, tuned=False)
        gemm_add_inplace(x_ND.T, dpre_N2F, w13_ED2F.grad, cu_seqlens_k=cu_E1, tuned=False)
        return dx_ND, None, None, None


class HybridExperts(torch.autograd.Function):
    """QuACK only where its epilogue fuses the gate; CUTLASS's grouped GEMMs and dyad's per-expert
    weight-gradient GEMMs (side streams, into .grad) for the rest."""

    @staticmethod
    def forward(ctx, x_ND, w13_ED2F, w2_EFD, offs_E, cu_E1, ends):
        preact_N2F, g_NF = gemm_act(x_ND, w13_ED2F, activation="swiglu", cu_seqlens_m=cu_E1, **kw())
        ctx.save_for_backward(x_ND, preact_N2F, w13_ED2F, w2_EFD, offs_E, cu_E1)
        ctx.ends = ends
        return F.grouped_mm(g_NF, w2_EFD, offs=offs_E)

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, preact_N2F, w13_ED2F, w2_EFD, offs_E, cu_E1 = ctx.saved_tensors
        dy_ND = dy_ND.contiguous()
        dpre_N2F, g_NF = gemm_dact(dy_ND, w2_EFD.mT, preact_N2F, activation="swiglu", cu_seqlens_m=cu_E1, tuned=False)
        sides = _side_streams_after_current(x_ND.device)
        add_weight_grads(w2_EFD, g_NF, dy_ND, ctx.ends, sides)
        dx_ND = F.grouped_mm(dpre_N2F, w13_ED2F.transpose(-2, -1), offs=offs_E)
        add_weight_grads(w13_ED2F, x_ND, dpre_N2F, ctx.ends, sides)
        return dx_ND, None, None, None, None, None


class PlainExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w1, w3, w2, cu_E1):
        h1 = gemm(x_ND, w1, cu_seqlens_m=cu_E1, tuned=False)
        h3 = gemm(x_ND, w3, cu_seqlens_m=cu_E1, tuned=False)
        ctx.save_for_backward(x_ND, h1, h3, w1, w3, w2, cu_E1)
        g = swiglu(h1, h3)
        return gemm(g, w2, cu_seqlens_m=cu_E1, tuned=False)

    @staticmethod
    def backward(ctx, dy):
        x_ND, h1, h3, w1, w3, w2, cu_E1 = ctx.saved_tensors
        dy = dy.contiguous()
        dg = gemm(dy, w2.mT, cu_seqlens_m=cu_E1, tuned=False)
        with torch.enable_grad():
            h1r, h3r = h1.detach().requires_grad_(), h3.detach().requires_grad_()
            g = swiglu(h1r, h3r)
            dh1, dh3 = torch.autograd.grad(g, [h1r, h3r], dg)
        gemm_add_inplace(g.detach().T, dy, w2.grad, cu_seqlens_k=cu_E1, tuned=False)
        dx = gemm(dh1, w1.mT, cu_seqlens_m=cu_E1, tuned=False)
        dx += gemm(dh3, w3.mT, cu_seqlens_m=cu_E1, tuned=False)
        gemm_add_inplace(x_ND.T, dh1, w1.grad, cu_seqlens_k=cu_E1, tuned=False)
        gemm_add_inplace(x_ND.T, dh3, w3.grad, cu_seqlens_k=cu_E1, tuned=False)
        return dx, None, None, None, None


def interleave(w1, w3):
    return torch.stack([w1, w3], dim=-1).flatten(-2)  # [E, D, 2F]: g0 u0 g1 u1 ...


def setup():
    torch.manual_seed(0)
    layer = dyad_layer(D, FF, E, K).to(dev, torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
        p.grad = torch.zeros_like(p)
    idx = torch.rand(T, E, device=dev).topk(K, dim=1).indices.flatten()
    counts = torch.bincount(idx, minlength=E)
    cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    w13 = interleave(layer.w1_EDF.detach(), layer.w3_EDF.detach()).requires_grad_()
    w13.grad = torch.zeros_like(w13)
    w2 = layer.w2_EFD
    return layer, counts, cu, x, dy, w13, w2


def steps(layer, counts, cu, x, dy, w13, w2):
    def dyad():
        layer.experts(x, counts).backward(dy)

    def fused():
        FusedExperts.apply(x, w13, w2, cu).backward(dy)

    def plain():
        PlainExperts.apply(x, layer.w1_EDF, layer.w3_EDF, w2, cu).backward(dy)

    offs, ends = cu[1:].contiguous(), cu[1:].tolist()

    def hybrid():
        HybridExperts.apply(x, w13, w2, offs, cu, ends).backward(dy)

    chosen = os.environ.get("VARIANTS", "dyad,hybrid,quack-fused,quack-plain").split(",")
    every = {"dyad": dyad, "hybrid": hybrid, "quack-fused": fused, "quack-plain": plain}
    return {name: every[name] for name in chosen}


def accuracy(layer, counts, cu, x, dy, w13, w2, fns):
    """Relative error of y, dx, dw2 of each variant against float32 math per expert."""
    with torch.no_grad():
        xs = x.float().split(counts.tolist())
        w1, w3, w2f = layer.w1_EDF.float(), layer.w3_EDF.float(), w2.float()
    res = {}
    ref_y, ref_dx, ref_dw2 = [], [], []
    torch.backends.cuda.matmul.allow_tf32 = False
    for e, xe in enumerate(xs):
        xe = xe.clone().requires_grad_()
        w2e = w2f[e].clone().requires_grad_()
        h1, h3 = xe @ w1[e], xe @ w3[e]
        ye = (torch.nn.functional.silu(h1) * h3) @ w2e
        dye = dy.float().split(counts.tolist())[e]
        gx, gw2 = torch.autograd.grad(ye, [xe, w2e], dye)
        ref_y.append(ye.detach())
        ref_dx.append(gx)
        ref_dw2.append(gw2)
    ref_y, ref_dx, ref_dw2 = torch.cat(ref_y), torch.cat(ref_dx), torch.stack(ref_dw2)

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    for name, fn in fns.items():
        try:
            x.grad = None
            w2.grad.zero_()
            if name == "dyad":
                y = layer.experts(x, counts)
            elif name == "quack-fused":
                y = FusedExperts.apply(x, w13, w2, cu)
            elif name == "hybrid":
                y = HybridExperts.apply(x, w13, w2, cu[1:].contiguous(), cu, cu[1:].tolist())
            else:
                y = PlainExperts.apply(x, layer.w1_EDF, layer.w3_EDF, w2, cu)
            y.backward(dy)
            if x.is_cuda:
                torch.cuda.synchronize()
            res[name] = {"y": rel(y, ref_y), "dx": rel(x.grad, ref_dx), "dw2": rel(w2.grad, ref_dw2)}
        except Exception:
            res[name] = {"error": traceback.format_exc()[-2000:]}
        print(name, res[name], flush=True)
    x.grad = None
    return res


def block_ms(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_sums(fn, steps=3):
    """Each kernel name's summed GPU time per step, largest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    sums = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            key = ev.name[:110]
            n, t = sums.get(key, (0, 0.0))
            sums[key] = (n + 1, t + ev.device_time)
    rows = sorted(((t / steps, n / steps, k) for k, (n, t) in sums.items()), reverse=True)
    for t, n, k in rows[:12]:
        print(f"  {t:9.1f} us  x{n:5.1f}  {k}", flush=True)
    return [[round(t, 1), n, k] for t, n, k in rows[:25]]


def main():
    state = setup()
    fns = steps(*state)
    out = {"device": torch.cuda.get_device_name(), "shape": [T, K, E, D, FF], "cfg": CFG, "torch": torch.__version__}
    out["counts"] = state[1].tolist()
    out["accuracy"] = accuracy(*state, fns)
    alive = {}
    for name, fn in fns.items():
        try:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            alive[name] = fn
        except Exception:
            print(name, "failed:", traceback.format_exc()[-3000:], flush=True)
    times = {name: [] for name in alive}
    names = list(alive)
    for r in range(ROUNDS):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(block_ms(alive[name], ITERS))
        print("round", r, {n: round(t[-1], 3) for n, t in times.items()}, flush=True)
    out["ms_per_step"] = {n: t for n, t in times.items()}
    out["median_ms"] = {n: statistics.median(t) for n, t in times.items()}
    print(json.dumps(out["median_ms"]), flush=True)
    out["kernels_us"] = {name: kernel_sums(fn) for name, fn in alive.items()}
    tag = os.environ.get("TAG", "run")
    with open(f"{OUT}/quack_{tag}.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
