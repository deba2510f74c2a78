"""Float8 matmuls for training: forward and input-gradient GEMMs in e4m3, weight gradients in the
compute dtype (bfloat16).

Legend: M rows (tokens), K contraction dim, N output dim; for grouped: E experts, D input dim,
F output dim, rows of x grouped by expert with int32 cumulative ends offs_E.

Scaling is per row: every row of the left operand and every output column of the right operand
gets its own power-of-two scale, so that its largest magnitude lands just under e4m3's maximum
(448). Powers of two make scaling and unscaling exact: the only error is e4m3's rounding
(3 mantissa bits). Weight gradients contract over tokens, whose per-row scales would differ
inside one sum, so they stay in the compute dtype.

Weights are quantized once per optimizer step (`forget_quantized_after_each_step`; the cache
also follows the tensor's version counter, which in-place updates such as a checkpoint restore
bump but fused optimizers do not), so the microbatches of one step and a layer's forward and
backward share one quantization.

Fast paths: `torch._scaled_mm` (CUDA sm89+) and `torch._scaled_grouped_mm` (CUDA sm90); other
devices multiply the dequantized codes, so CPU runs compute the same function, without speed.
References: dequantize to float32 and multiply with plain matmuls (`linear_reference`,
`grouped_mm_reference`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dyad.kernels.fp8_layouts import scale_into_both_layouts
from dyad.kernels.grouped_mm import grouped_mm_reference as plain_grouped_mm_reference
from dyad.kernels.traceable import to_dtype

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
_TINY = 1e-12  # all-zero rows get scale 2^k for amax _TINY; their codes are zeros either way
_CACHE_ATTR = "_dyad_fp8_cache"


def quantize(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in e4m3, inverse scales) with one power-of-two scale per slice along `dim`:
    t ~= codes.float() * inverse_scales, inverse scales float32 with `dim` kept as size 1."""
    scale = _power_of_two_scales(t, dim)
    # scale * amax <= 448 and multiplying by a power of two is exact, so no value exceeds e4m3's
    # range: no clamp pass over the tensor is needed before the cast.
    codes = (t.detach() * scale.to(t.dtype)).to(E4M3)
    return codes, scale.reciprocal()


def _power_of_two_scales(t: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 powers of two, `dim` kept as size 1, that bring each slice's amax just under 448."""
    amax = torch.linalg.vector_norm(t.detach(), ord=math.inf, dim=dim, keepdim=True).float().clamp(min=_TINY)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return torch.where(scale * amax > E4M3_MAX, scale / 2, scale)  # log2's rounding at a boundary


_quantize = quantize  # what the GEMMs call; `compile_quantization` swaps in a fused one


def compile_quantization() -> None:
    """Have the float8 GEMMs quantize with `torch.compile(quantize)`: the row maximum, scaling
    and cast fused into few kernels instead of eager passes over the tensor."""
    global _quantize
    # one graph per (rank, dtype, reduced dim): activations, gradients, both weight layouts
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    _quantize = torch.compile(quantize, dynamic=True)


def dequantize(codes: torch.Tensor, inverse_scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * inverse_scales


def cached_per_version(w: torch.Tensor, key, make):
    """make(w), computed once per in-place version of `w` and kept on the tensor."""
    entries = _cache_entries(w)
    if key not in entries:
        entries[key] = make(w)
    return entries[key]


def _cache_entries(w: torch.Tensor) -> dict:
    version, entries = getattr(w, _CACHE_ATTR, (None, None))
    if version != w._version:
        version, entries = w._version, {}
        setattr(w, _CACHE_ATTR, (version, entries))
    return entries


def forget_quantized(params) -> None:
    """Drop the cached weight codes of `params` (a module's or an iterable of tensors)."""
    for p in params.parameters() if isinstance(params, torch.nn.Module) else params:
        p.__dict__.pop(_CACHE_ATTR, None)


def forget_quantized_after_each_step(optimizer: torch.optim.Optimizer) -> None:
    """Make every `optimizer.step()` drop its parameters' cached codes. Needed because fused
    optimizers update weights in place without bumping their version counters."""

    def forget(opt, args, kwargs):
        forget_quantized(p for group in opt.param_groups for p in group["params"])

    optimizer.register_step_post_hook(forget)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a plain matmul of `x` would produce: autocast's when it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


# ---- dense: y = x @ w.T ----------------------------------------------------------------------------


def _scaled_mm(a_MK, a_inv_M1, b_NK, b_inv_N1, out_dtype):
    """a @ b.T from e4m3 codes with row scales on both sides. Off CUDA (where float8 brings no
    speed, and older CPU builds take only one scale per tensor) from the dequantized codes."""
    if a_MK.device.type != "cuda":
        return to_dtype(dequantize(a_MK, a_inv_M1) @ dequantize(b_NK, b_inv_N1).t(), out_dtype)
    return torch._scaled_mm(
        a_MK,
        b_NK.t(),
        scale_a=a_inv_M1,
        scale_b=b_inv_N1.t(),
        out_dtype=out_dtype,
        use_fast_accum=True,
    )


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, out_dtype):
        x_codes, x_inv = _quantize(x_MK, dim=1)
        w_codes, w_inv = cached_per_version(w_NK, "rows", lambda w: _quantize(w, dim=1))
        ctx.save_for_backward(x_MK, w_NK)
        ctx.out_dtype = out_dtype
        return _scaled_mm(x_codes, x_inv, w_codes, w_inv, out_dtype)

    @staticmethod
    def backward(ctx, grad_MN):
        x_MK, w_NK = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # grad_x = grad @ w: rows of w.T scaled over N
            g_codes, g_inv = _quantize(grad_MN, dim=1)
            wt_codes, wt_inv = _transposed_codes(w_NK)
            grad_x = _scaled_mm(g_codes, g_inv, wt_codes, wt_inv, ctx.out_dtype).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_MN.t() @ x_MK.to(grad_MN.dtype)).to(w_NK.dtype)
        return grad_x, grad_w, None


def _transposed_codes(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w.T as row-major codes [K, N] with one scale per row (over N), cached with the weight."""

    def make(w):
        codes, inv = _quantize(w, dim=0)
        return codes.t().contiguous(), inv.t()

    return cached_per_version(w_NK, "columns", make)


def fp8_linear(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (no bias) with e4m3 forward and input-gradient GEMMs."""
    out_dtype = compute_dtype(x)
    x_MK = x.reshape(-1, x.shape[-1])
    with torch.autocast(x.device.type, enabled=False):
        y_MN = _Fp8Linear.apply(x_MK, w_NK, out_dtype)
    return y_MN.view(*x.shape[:-1], w_NK.shape[0])


def linear_reference(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """What `fp8_linear` computes forward, in plain PyTorch: quantize, dequantize, matmul."""
    x_MK = x.reshape(-1, x.shape[-1])
    y_MN = dequantize(*quantize(x_MK, 1)) @ dequantize(*quantize(w_NK, 1)).t()
    return y_MN.to(compute_dtype(x)).view(*x.shape[:-1], w_NK.shape[0])


# ---- grouped: y[rows of e] = x[rows of e] @ w[e] ------------------------------------------------


def _grouped_scaled_mm(x_codes_ND, x_inv_N1, w_codes_EFD, w_inv_EF1, offs_E, out_dtype):
    """Row block e of x times w[e] (given as w[e].T row-major codes [F, D]) from e4m3 codes."""
    if x_codes_ND.device.type == "cuda":
        return torch._scaled_grouped_mm(
            x_codes_ND,
            w_codes_EFD.transpose(1, 2),
            x_inv_N1.squeeze(1),
            w_inv_EF1.squeeze(2),
            offs=offs_E,
            out_dtype=out_dtype,
            use_fast_accum=True,
        )
    out_NF = x_codes_ND.new_empty((x_codes_ND.shape[0], w_codes_EFD.shape[1]), dtype=out_dtype)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            out_NF[start:end] = _scaled_mm(
                x_codes_ND[start:end],
                x_inv_N1[start:end],
                w_codes_EFD[e],
                w_inv_EF1[e],
                out_dtype,
            )
        start = end
    return out_NF


def _expert_codes(
    w_EDF: torch.Tensor, contract_dim: int, *, with_other_layout: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of w[e] as row-major [out, contraction] with one scale per output row, cached.
    contract_dim 1: forward (contract over D, out F); 2: input gradient (contract over F, out D).
    with_other_layout: make both in one pass over the weight (the backward will need the other)."""
    entries = _cache_entries(w_EDF)
    key = ("experts", contract_dim)
    if key not in entries:
        made = _both_expert_layouts(w_EDF) if with_other_layout else {key: _one_expert_layout(w_EDF, contract_dim)}
        entries.update(made)
    return entries[key]


def _both_expert_layouts(w_EDF: torch.Tensor) -> dict:
    over_F_ED1, over_D_E1F = _power_of_two_scales(w_EDF, 2), _power_of_two_scales(w_EDF, 1)
    codes_EDF, codes_EFD = scale_into_both_layouts(w_EDF, over_F_ED1, over_D_E1F)
    return {
        ("experts", 1): (codes_EFD, over_D_E1F.reciprocal().transpose(1, 2)),
        ("experts", 2): (codes_EDF, over_F_ED1.reciprocal()),
    }


def _one_expert_layout(w, contract_dim):
    codes, inv = _quantize(w, dim=contract_dim)
    if contract_dim == 1:  # [E, D, F] scaled over D -> [E, F, D] rows
        return codes.transpose(1, 2).contiguous(), inv.transpose(1, 2)
    return codes, inv  # [E, D, F] scaled over F is already [E, out D, contraction F]


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w_EDF, offs_E, out_dtype):
        x_codes, x_inv = _quantize(x_ND, dim=1)
        w_codes, w_inv = _expert_codes(w_EDF, contract_dim=1, with_other_layout=ctx.needs_input_grad[0])
        ctx.save_for_backward(x_ND, w_EDF, offs_E)
        ctx.out_dtype = out_dtype
        return _grouped_scaled_mm(x_codes, x_inv, w_codes, w_inv, offs_E, out_dtype)

    @staticmethod
    def backward(ctx, grad_NF):
        x_ND, w_EDF, offs_E = ctx.saved_tensors
        grad_NF = grad_NF.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_codes, g_inv = _quantize(grad_NF, dim=1)
            wt_codes, wt_inv = _expert_codes(w_EDF, contract_dim=2)
            grad_x = _grouped_scaled_mm(g_codes, g_inv, wt_codes, wt_inv, offs_E, ctx.out_dtype).to(x_ND.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _grouped_weight_grad(x_ND.to(grad_NF.dtype), grad_NF, offs_E).to(w_EDF.dtype)
        return grad_x, grad_w, None, None


def _grouped_weight_grad(x_ND, grad_NF, offs_E):
    """grad_w[e] = x[rows of e].T @ grad[rows of e] in the compute dtype (zero for empty groups)."""
    if getattr(F, "grouped_mm", None) is not None and (x_ND.device.type == "cpu" or x_ND.dtype == torch.bfloat16):
        return F.grouped_mm(x_ND.t(), grad_NF, offs=offs_E)
    grad_w = grad_NF.new_zeros((offs_E.numel(), x_ND.shape[1], grad_NF.shape[1]))
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        grad_w[e] = x_ND[start:end].t() @ grad_NF[start:end]
        start = end
    return grad_w


def fp8_grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """`kernels.grouped_mm.grouped_mm` with e4m3 forward and input-gradient GEMMs."""
    out_dtype = compute_dtype(x_ND)
    with torch.autocast(x_ND.device.type, enabled=False):
        return _Fp8GroupedMM.apply(x_ND.contiguous(), w_EDF, offs_E.to(torch.int32), out_dtype)


def grouped_mm_reference(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """What `fp8_grouped_mm` computes forward, in plain PyTorch: quantize, dequantize, matmul."""
    x, w = dequantize(*quantize(x_ND, 1)), dequantize(*quantize(w_EDF, 1))
    return plain_grouped_mm_reference(x, w, offs_E).to(compute_dtype(x_ND))
