"""SwiGLU experts over one gate-up weight whose column pairs are (gate, up), the gate applied in
the epilogues of the expert GEMMs.

Legend: N rows (expert-major), D model dim, F expert ffn dim, E experts. w13_ED2F holds expert
e's gate column j at [e, :, 2j] and its up column at [e, :, 2j + 1].

`gated_experts_reference` is the plain path: one grouped GEMM for both projections (h13), SwiGLU
over its column pairs (`swiglu_pairs`, one Triton pass each way on CUDA), the down-projection.
On Hopper GPUs with QuACK installed (`quack-kernels`, the CuTe-DSL kernels of Dao AI Lab; see
docs/performance.md for the versions) `gated_experts` moves SwiGLU into two GEMM epilogues
instead, saving the gate's passes over memory (1.9 GB read and 0.9 GB written forward, 2.8 GB
read and 1.9 GB written backward, on the Mixtral-like layer):
- forward, QuACK's `gemm_act` writes h13 (kept for the backward) and silu(h1) * h3 from the
  float32 accumulator of x @ w13, so the product is rounded once, where the reference rounds h1
  and h3 first;
- backward, QuACK's `gemm_dact` computes dg = dy @ w2^T and from it and h13 the gradient of h13
  and g = silu(h1) * h3 again (for w2's weight gradient) in its epilogue.
Without autotuning the forward GEMM launches through QuACK's prepared launch (`EpiPlan`, one per
metadata class: shapes, strides, dtypes), the kernel and configuration `gemm_act` picks, without
its per-call resolution: the launch is the last host work before the layer's first expert GEMM
starts, while a step that starts from an idle GPU waits for it.
The other GEMMs stay PyTorch's: the down-projection and the input gradient are CUTLASS grouped
GEMMs (faster here than QuACK's plain ones), and the weight gradients are added into `.grad` by
one cuBLAS GEMM per expert on the side streams of `expert_weight_grads`, with the same conditions
(few experts, CUDA leaf weights, outside torch.compile).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dyad.kernels.expert_weight_grads import (
    MAX_EXPERTS,
    RowEndsOnHost,
    _gradient_owner,
    _side_streams_after_current,
    add_weight_grads,
)
from dyad.kernels.grouped_mm import _autocast, _standard_strides, supports_fast_path
from dyad.kernels.swiglu import swiglu_pairs


def gated_experts_reference(x_ND, w13_ED2F, w2_EFD, offs_E, matmul) -> torch.Tensor:
    return matmul(swiglu_pairs(matmul(x_ND, w13_ED2F, offs_E)), w2_EFD, offs_E)


def gated_experts(x_ND, w13_ED2F, w2_EFD, offs_E, matmul, autotune: bool = False) -> torch.Tensor:
    """The experts' output rows: SwiGLU(x @ w13) @ w2 per row block, as the reference computes.
    With `autotune`, QuACK times its tile configurations for the two fused GEMMs on the first call
    of each new shape (each new row count is one) and keeps the fastest; otherwise it takes its
    default configuration. The layer does not ask for it: on the Mixtral-like layer the default
    was as fast."""
    x_c, w13_c, w2_c = _autocast(x_ND), _autocast(w13_ED2F), _autocast(w2_EFD)
    owners = _gradient_owner(w13_ED2F), _gradient_owner(w2_EFD)
    if not _fused_applies(x_c, w13_c, w2_c, owners):
        return gated_experts_reference(x_ND, w13_ED2F, w2_EFD, offs_E, matmul)
    # The owners are inputs so that autograd records the node (and calls its backward) also when
    # x does not require a gradient; the node returns none for them and adds into their .grad.
    return _GatedExperts.apply(x_c, *owners, w13_c.detach(), w2_c.detach(), offs_E.to(torch.int32), autotune)


def _fused_applies(x_ND, w13_ED2F, w2_EFD, owners) -> bool:
    return (
        x_ND.is_cuda
        and x_ND.dtype == torch.bfloat16
        and torch.is_grad_enabled()
        and all(w.is_leaf and w.requires_grad and w.is_cuda for w in owners)
        and w13_ED2F.shape[0] <= MAX_EXPERTS
        and not torch.compiler.is_compiling()
        and supports_fast_path(x_ND, w13_ED2F)
        and supports_fast_path(x_ND, w2_EFD.transpose(-2, -1))
        and torch.cuda.get_device_capability(x_ND.device)[0] == 9
        and _quack() is not None
    )


@functools.cache
def _quack():
    """QuACK's gemm_act and gemm_dact, or None where it is not installed."""
    try:
        from quack.gemm_interface import gemm_act, gemm_dact
    except ImportError:
        return None
    return gemm_act, gemm_dact


def _row_starts(offs_E: torch.Tensor) -> torch.Tensor:
    """QuACK's cumulative row counts: offs with a leading zero."""
    return F.pad(offs_E, (1, 0))


def gated_up_projection(x_ND, w13_ED2F, starts_E1, autotune: bool = False):
    """(h13_N2F, g_NF): QuACK's `gemm_act(x, w13, activation="swiglu")` per row block (starts_E1:
    the blocks' first rows and the end). Without `autotune`, through the prepared launch."""
    if autotune:
        gemm_act, _ = _quack()
        return gemm_act(x_ND, w13_ED2F, activation="swiglu", cu_seqlens_m=starts_E1, tuned=True)
    (N, _), two_F = x_ND.shape, w13_ED2F.shape[-1]
    out = {
        "D": torch.empty(N, two_F, dtype=x_ND.dtype, device=x_ND.device),
        "mAuxOut": torch.empty(N, two_F // 2, dtype=x_ND.dtype, device=x_ND.device),
    }
    plan = _up_projection_plan(x_ND, w13_ED2F, starts_E1, out)
    semaphore = torch.zeros(1, dtype=torch.int32, device=x_ND.device) if plan.config.is_dynamic_persistent else None
    plan.run(x_ND, w13_ED2F, None, out=out, cu_seqlens_m=starts_E1, tile_count_semaphore=semaphore)
    return out["D"], out["mAuxOut"]


_PLANS_KEPT = 64  # metadata classes (each new row count is one); the oldest are dropped beyond
_up_projection_plans: dict = {}


def _up_projection_plan(x_ND, w13_ED2F, starts_E1, out):
    """QuACK's EpiPlan of gemm_act's SwiGLU epilogue for these operands' metadata, made (and, the
    first time, compiled) on first sight with the configuration gemm_act takes untuned."""
    key = tuple((t.dtype, tuple(t.shape), t.stride(), t.device) for t in (x_ND, w13_ED2F, starts_E1))
    plan = _up_projection_plans.get(key)
    if plan is None:
        from quack.epilogue.library import linear_act_mod

        mod = linear_act_mod("swiglu", gated=True, has_c=False, has_rowvec=False, has_colvec=False)
        plan = mod.plan(x_ND, w13_ED2F, None, out=out, cu_seqlens_m=starts_E1)
        if len(_up_projection_plans) >= _PLANS_KEPT:
            _up_projection_plans.pop(next(iter(_up_projection_plans)))
        _up_projection_plans[key] = plan
    return plan


class _GatedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w13_owner, w2_owner, w13_ED2F, w2_EFD, offs_E, autotune):
        starts_E1 = _row_starts(offs_E)
        h13_N2F, g_NF = gated_up_projection(x_ND, w13_ED2F, starts_E1, autotune)
        ctx.owners, ctx.autotune = (w13_owner, w2_owner), autotune
        ctx.row_ends = RowEndsOnHost(offs_E)
        ctx.save_for_backward(x_ND, h13_N2F, w13_ED2F, w2_EFD, offs_E, starts_E1)
        return F.grouped_mm(g_NF, w2_EFD, offs=offs_E)

    @staticmethod
    def backward(ctx, grad_ND):
        _, gemm_dact = _quack()
        x_ND, h13_N2F, w13_ED2F, w2_EFD, offs_E, starts_E1 = ctx.saved_tensors
        grad_ND = _standard_strides(grad_ND)
        grad_h13_N2F, g_NF = gemm_dact(
            grad_ND,
            w2_EFD.transpose(-2, -1),
            h13_N2F,
            activation="swiglu",
            cu_seqlens_m=starts_E1,
            tuned=ctx.autotune,
        )
        ends = ctx.row_ends.get()
        sides = _side_streams_after_current(x_ND.device)
        w13_owner, w2_owner = ctx.owners
        add_weight_grads(w2_owner, g_NF, grad_ND, ends, sides)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = F.grouped_mm(grad_h13_N2F, w13_ED2F.transpose(-2, -1), offs=offs_E)
        add_weight_grads(w13_owner, x_ND, grad_h13_N2F, ends, sides)
        return grad_x, None, None, None, None, None, None
