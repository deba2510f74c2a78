"""The MoE router's two steps, each in one pass on CUDA: its logits, and the softmax top-k gates.

Legend: T tokens, D model dim, E experts, K experts per token.

- `router_logits(x_TD, w_ED)`: x @ w^T in float32. The reference casts both to float32 and
  multiplies (an SGEMM); with bf16 activations that writes a float32 copy of x forward and a
  float32 gradient backward, then casts it (on the Mixtral-like layer, 8,192 x 4,096: about
  0.5 ms of the layer's 29). Here Triton kernels read x in its own dtype and compute in float32
  (tensor-core "3xTF32": float32 accuracy; x's bf16/fp16 values are exact in TF32), whatever
  w's dtype: logits forward; backward the input
  gradient rounded once to x's dtype and the weight gradient summed in float32 over T (in a
  fixed order: per block of rows, then over the blocks).
- `softmax_topk(logits_TE, k, bias_E, normalize)`: scores = softmax(logits); the k largest of
  scores (+ bias, which only selects) per token, largest first, ties to the lower expert;
  gates = the chosen scores, divided by their sum (+1e-20) when `normalize`. One program per
  block of tokens instead of softmax, sort, gather, sum and divide; the backward (scores and
  gates to logits) is plain PyTorch, launched while the expert GEMMs run.

Both fall back to their `*_reference` (plain PyTorch) off CUDA, under torch.compile (inductor
fuses the references itself), without Triton, and for float32 activations (float32 runs check
the math, so they keep computing exactly what they computed before).
"""

from __future__ import annotations

import functools
from collections import namedtuple

import torch
import torch.nn.functional as F

from dyad.kernels.launch_sizes import cdiv, next_pow2

_DTYPES = (torch.bfloat16, torch.float16)
_Kernels = namedtuple("_Kernels", "logits input_grad weight_grad softmax_topk")
_TOPK_MAX_EXPERTS = 256  # one block of tokens holds every expert's score in registers


# ---- plain PyTorch -------------------------------------------------------------------------------


def router_logits_reference(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x_TD.device.type, enabled=False):
        return F.linear(x_TD.float(), w_ED.float())


def softmax_topk_reference(
    logits_TE: torch.Tensor, k: int, bias_E: torch.Tensor | None = None, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (scores_TE, gates_TK, expert_idx_TK)."""
    scores_TE = torch.softmax(logits_TE, dim=-1)
    key_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    expert_idx_TK = torch.sort(key_TE, dim=-1, descending=True, stable=True).indices[:, :k]
    gates_TK = scores_TE.gather(1, expert_idx_TK)
    if normalize:  # the epsilon only matters for underflowed scores
        gates_TK = gates_TK / (gates_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return scores_TE, gates_TK, expert_idx_TK


# ---- dispatch ------------------------------------------------------------------------------------


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    if not (_fused_applies(x_TD) and x_TD.dim() == 2 and x_TD.shape[0] > 0 and w_ED.is_cuda):
        return router_logits_reference(x_TD, w_ED)
    return _RouterLogits.apply(x_TD.contiguous(), w_ED)


def softmax_topk(
    logits_TE: torch.Tensor, k: int, bias_E: torch.Tensor | None = None, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fused = (
        logits_TE.is_cuda
        and logits_TE.dtype == torch.float32
        and logits_TE.dim() == 2
        and logits_TE.shape[0] > 0
        and logits_TE.shape[1] <= _TOPK_MAX_EXPERTS
        and not torch.compiler.is_compiling()
        and _kernels() is not None
    )
    if not fused:
        return softmax_topk_reference(logits_TE, k, bias_E, normalize)
    return _SoftmaxTopK.apply(logits_TE.contiguous(), k, bias_E, normalize)


def _fused_applies(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in _DTYPES and not torch.compiler.is_compiling() and _kernels() is not None


def _experts_padded(E: int) -> int:
    return max(16, next_pow2(E))  # tl.dot needs 16 or more


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_ED):
        ctx.save_for_backward(x_TD, w_ED)
        T, D = x_TD.shape
        E = w_ED.shape[0]
        logits_TE = torch.empty(T, E, dtype=torch.float32, device=x_TD.device)
        kernels = _kernels()
        grid = (cdiv(T, _LOGITS_BLOCK_T),)
        kernels.logits[grid](x_TD, w_ED.contiguous(), logits_TE, T, D, E,
                             E_P=_experts_padded(E), BLOCK_T=_LOGITS_BLOCK_T, BLOCK_D=_BLOCK_D)
        return logits_TE

    @staticmethod
    def backward(ctx, grad_TE):
        x_TD, w_ED = ctx.saved_tensors
        T, D = x_TD.shape
        E = w_ED.shape[0]
        grad_TE = grad_TE.contiguous()
        kernels, E_P = _kernels(), _experts_padded(E)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x_TD)
            grid = (cdiv(T, _BLOCK_T), cdiv(D, _BLOCK_D))
            kernels.input_grad[grid](grad_TE, w_ED.contiguous(), grad_x, T, D, E,
                                     E_P=E_P, BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D)
        if ctx.needs_input_grad[1]:
            splits = max(1, min(_WEIGHT_GRAD_SPLITS, cdiv(T, _BLOCK_T)))
            partial_SED = torch.empty(splits, E, D, dtype=torch.float32, device=x_TD.device)
            grid = (cdiv(D, _BLOCK_D), splits)
            kernels.weight_grad[grid](grad_TE, x_TD, partial_SED, T, D, E, cdiv(T, splits),
                                      E_P=E_P, BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D)
            grad_w = partial_SED.sum(dim=0).to(w_ED.dtype)
        return grad_x, grad_w


class _SoftmaxTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, k, bias_E, normalize):
        T, E = logits_TE.shape
        scores_TE = torch.empty_like(logits_TE)
        gates_TK = torch.empty(T, k, dtype=torch.float32, device=logits_TE.device)
        expert_idx_TK = torch.empty(T, k, dtype=torch.long, device=logits_TE.device)
        has_bias = bias_E is not None
        bias = bias_E.float().contiguous() if has_bias else logits_TE  # unread without a bias
        _kernels().softmax_topk[(cdiv(T, _TOPK_BLOCK_T),)](
            logits_TE, bias, scores_TE, gates_TK, expert_idx_TK, T, E, K=k, K_P=next_pow2(k),
            E_P=_experts_padded(E), HAS_BIAS=has_bias, NORMALIZE=normalize, BLOCK_T=_TOPK_BLOCK_T)
        ctx.save_for_backward(scores_TE, gates_TK, expert_idx_TK)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(expert_idx_TK)
        return scores_TE, gates_TK, expert_idx_TK

    @staticmethod
    def backward(ctx, grad_scores_TE, grad_gates_TK, _):
        scores_TE, gates_TK, expert_idx_TK = ctx.saved_tensors
        grad_TE = torch.zeros_like(scores_TE) if grad_scores_TE is None else grad_scores_TE.clone()
        if grad_gates_TK is not None:
            grad_chosen_TK = grad_gates_TK
            if ctx.normalize:  # gates = s / Z: d s_j = (g_j - sum_k g_k gates_k) / Z
                chosen_TK = scores_TE.gather(1, expert_idx_TK)
                total_T1 = chosen_TK.sum(dim=-1, keepdim=True) + 1e-20
                grad_chosen_TK = (grad_gates_TK - (grad_gates_TK * gates_TK).sum(-1, keepdim=True)) / total_T1
            grad_TE.scatter_add_(1, expert_idx_TK, grad_chosen_TK)
        grad_logits_TE = scores_TE * (grad_TE - (grad_TE * scores_TE).sum(dim=-1, keepdim=True))
        return grad_logits_TE, None, None, None


# ---- Triton --------------------------------------------------------------------------------------

_BLOCK_T = 64
_LOGITS_BLOCK_T = 32  # more programs: each streams its rows of x once
_BLOCK_D = 64
_WEIGHT_GRAD_SPLITS = 16
_TOPK_BLOCK_T = 32


@functools.cache
def _kernels():
    """The Triton kernels (logits, input_grad, weight_grad, softmax_topk), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def logits(x_ptr, w_ptr, out_ptr, T, D, E, E_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.arange(0, E_P)
        acc = tl.zeros((BLOCK_T, E_P), dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=(t[:, None] < T) & (d[None, :] < D), other=0.0)
            w = tl.load(w_ptr + e[None, :] * D + d[:, None], mask=(e[None, :] < E) & (d[:, None] < D), other=0.0)
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="tf32x3")
        tl.store(out_ptr + t[:, None] * E + e[None, :], acc, mask=(t[:, None] < T) & (e[None, :] < E))

    @triton.jit
    def input_grad(g_ptr, w_ptr, out_ptr, T, D, E, E_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        e = tl.arange(0, E_P)
        g = tl.load(g_ptr + t[:, None] * E + e[None, :], mask=(t[:, None] < T) & (e[None, :] < E), other=0.0)
        w = tl.load(w_ptr + e[:, None] * D + d[None, :], mask=(e[:, None] < E) & (d[None, :] < D), other=0.0)
        grad = tl.dot(g, w.to(tl.float32), input_precision="tf32x3")
        tl.store(out_ptr + t[:, None] * D + d[None, :], grad.to(out_ptr.dtype.element_ty),
                 mask=(t[:, None] < T) & (d[None, :] < D))

    @triton.jit
    def weight_grad(g_ptr, x_ptr, out_ptr, T, D, E, rows_per_split, E_P: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        split = tl.program_id(1)
        e = tl.arange(0, E_P)
        acc = tl.zeros((E_P, BLOCK_D), dtype=tl.float32)
        first = split * rows_per_split
        for start in range(first, tl.minimum(first + rows_per_split, T), BLOCK_T):
            t = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
            inside = (t < T) & (t < first + rows_per_split)
            g = tl.load(g_ptr + t[None, :] * E + e[:, None], mask=inside[None, :] & (e[:, None] < E), other=0.0)
            x = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=inside[:, None] & (d[None, :] < D), other=0.0)
            acc += tl.dot(g, x.to(tl.float32), input_precision="tf32x3")
        tl.store(out_ptr + (split * E + e[:, None]).to(tl.int64) * D + d[None, :], acc,
                 mask=(e[:, None] < E) & (d[None, :] < D))

    @triton.jit
    def softmax_topk(logits_ptr, bias_ptr, scores_ptr, gates_ptr, idx_ptr, T, E, K: tl.constexpr, K_P: tl.constexpr,
                     E_P: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.arange(0, E_P)
        j = tl.arange(0, K_P)
        inside = (t[:, None] < T) & (e[None, :] < E)
        logits = tl.load(logits_ptr + t[:, None] * E + e[None, :], mask=inside, other=0.0)
        logits = tl.where(e[None, :] < E, logits, -float("inf"))  # rows past T stay finite
        shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = shifted / tl.sum(shifted, axis=1)[:, None]
        tl.store(scores_ptr + t[:, None] * E + e[None, :], scores, mask=inside)
        key = scores
        if HAS_BIAS:
            key = scores + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :]
        key = tl.where(e[None, :] < E, key, -float("inf"))
        gates = tl.zeros((BLOCK_T, K_P), dtype=tl.float32)
        idx = tl.zeros((BLOCK_T, K_P), dtype=tl.int64)
        for rank in tl.static_range(K):
            best = tl.argmax(key, axis=1, tie_break_left=True)
            chosen = e[None, :] == best[:, None]
            gate = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
            gates = tl.where(j[None, :] == rank, gate[:, None], gates)
            idx = tl.where(j[None, :] == rank, best[:, None].to(tl.int64), idx)
            key = tl.where(chosen, -float("inf"), key)
        if NORMALIZE:
            gates = gates / (tl.sum(gates, axis=1)[:, None] + 1e-20)
        at = t[:, None] * K + j[None, :]
        stored = (t[:, None] < T) & (j[None, :] < K)
        tl.store(gates_ptr + at, gates, mask=stored)
        tl.store(idx_ptr + at, idx, mask=stored)

    return _Kernels(logits, input_grad, weight_grad, softmax_topk)
