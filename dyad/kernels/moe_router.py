"""The MoE router's two steps, each in one pass on CUDA: its logits, and the softmax top-k gates.

Legend: T tokens, D model dim, E experts, K experts per token.

- `router_logits(x_TD, w_ED)`: x @ w^T in float32. The reference casts both to float32 and
  multiplies (an SGEMM); with bf16 activations that writes a float32 copy of x forward and a
  float32 gradient backward, then casts it (8,192 x 4,096 on the Mixtral-like layer). Here
  Triton kernels read x in its own dtype and compute in float32
  whatever w's dtype: logits forward; backward the input gradient rounded once to x's dtype and
  the weight gradient summed in float32 over T (in a fixed order: per block of rows, then over
  the blocks). The products are exact and summed in float32 on tensor cores: with bf16 x, a
  float32 operand is split into three bf16 pieces whose sum is it (`bf16_pieces` in
  `dyad/kernels/moe_router_triton.py`), and each piece's product with a bf16 operand is exact;
  otherwise (fp16 x, or a float32 w against the float32 logits gradient) "3xTF32", float32
  accuracy (16-bit values are exact in TF32).
- `softmax_topk(logits_TE, k, bias_E, normalize)`: scores = softmax(logits); the k largest of
  scores (+ bias, which only selects) per token, largest first, ties to the lower expert;
  gates = the chosen scores, divided by their sum (+1e-20) when `normalize`. One program per
  block of tokens instead of softmax, sort, gather, sum and divide; the backward (scores and
  gates to logits) is plain PyTorch, launched while the expert GEMMs run.
- `route_softmax_topk(x_TD, w_ED, k, bias_E, normalize)`: the two above as one launch forward
  (the logits kernel's blocks go on to the softmax and the top k in registers), which the MoE
  layer calls: one launch and one autograd node fewer before the first expert GEMM can start.

Both fall back to their `*_reference` (plain PyTorch) off CUDA, under torch.compile (inductor
fuses the references itself), without Triton, and for float32 activations (float32 runs check
the math, so they keep computing exactly what they computed before).
"""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn.functional as F

from dyad.kernels.launch_sizes import cdiv, next_pow2
from dyad.kernels.triton_modules import triton_module

_DTYPES = (torch.bfloat16, torch.float16)
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
    if not _logits_kernel_applies(x_TD, w_ED):
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


def route_softmax_topk(
    x_TD: torch.Tensor, w_ED: torch.Tensor, k: int, bias_E: torch.Tensor | None = None, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`softmax_topk(router_logits(x_TD, w_ED), k, bias_E, normalize)`; where both kernels apply,
    in one launch forward (`logits_softmax_topk`: the logits stay in registers, unwritten)."""
    if not (_logits_kernel_applies(x_TD, w_ED) and w_ED.shape[0] <= _TOPK_MAX_EXPERTS):
        return softmax_topk(router_logits(x_TD, w_ED), k, bias_E, normalize)
    return _RouteSoftmaxTopK.apply(x_TD.contiguous(), w_ED, k, bias_E, normalize)


def _logits_kernel_applies(x_TD: torch.Tensor, w_ED: torch.Tensor) -> bool:
    return (
        x_TD.is_cuda
        and w_ED.is_cuda
        and x_TD.dtype in _DTYPES
        and x_TD.dim() == 2
        and x_TD.shape[0] > 0
        and not torch.compiler.is_compiling()
        and _kernels() is not None
    )


def _experts_padded(E: int) -> int:
    return max(16, next_pow2(E))  # tl.dot needs 16 or more


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_ED):
        ctx.save_for_backward(x_TD, w_ED)
        return fused_logits(x_TD, w_ED.contiguous())

    @staticmethod
    def backward(ctx, grad_TE):
        x_TD, w_ED = ctx.saved_tensors
        return logits_backward(grad_TE, x_TD, w_ED, *ctx.needs_input_grad[:2])


def logits_backward(grad_TE, x_TD, w_ED, x_needs_grad: bool, w_needs_grad: bool):
    """(grad x, grad w) of the logits x @ w^T, each None where not needed."""
    grad_TE, w_ED = grad_TE.contiguous(), w_ED.contiguous()
    grad_x = fused_input_grad(grad_TE, x_TD, w_ED) if x_needs_grad else None
    grad_w = fused_weight_grad(grad_TE, x_TD, w_ED) if w_needs_grad else None
    return grad_x, grad_w


# One launch each, contiguous CUDA operands (`bench/router_kernels.py --sweep` times them alone).
# MATH is how a kernel multiplies; the operands' products are exact in each: "native" both bf16,
# one tensor-core pass; "bf16_pieces" a float32 operand in three bf16 pieces against a bf16 one,
# three passes; "tf32x3" both widened to float32.


def fused_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    (T, D), E = x_TD.shape, w_ED.shape[0]
    logits_TE = torch.empty(T, E, dtype=torch.float32, device=x_TD.device)
    E_P = _experts_padded(E)
    launch = _launch("logits", E_P)
    _kernels().logits[(cdiv(T, launch.block_t),)](
        x_TD, w_ED, logits_TE, T, D, E, zero=0.0, E_P=E_P, MATH=_logits_math(x_TD, w_ED), BLOCK_T=launch.block_t,
        BLOCK_D=launch.block_d, num_warps=launch.warps, num_stages=launch.stages)
    return logits_TE


def _logits_math(x_TD: torch.Tensor, w_ED: torch.Tensor) -> str:
    if x_TD.dtype == torch.bfloat16:
        return {torch.bfloat16: "native", torch.float32: "bf16_pieces"}.get(w_ED.dtype, "tf32x3")
    return "tf32x3"


def fused_input_grad(grad_TE: torch.Tensor, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """grad @ w, rounded once to x's dtype."""
    (T, D), E = x_TD.shape, w_ED.shape[0]
    grad_x = torch.empty_like(x_TD)
    E_P = _experts_padded(E)
    launch = _launch(input_grad_launch_key(w_ED.dtype), E_P)
    _kernels().input_grad[(cdiv(T, launch.block_t),)](
        grad_TE, w_ED, grad_x, T, D, E, E_P=E_P, MATH=_pieces_against(w_ED), BLOCK_T=launch.block_t,
        BLOCK_D=launch.block_d, num_warps=launch.warps, num_stages=launch.stages)
    return grad_x


def fused_weight_grad(grad_TE: torch.Tensor, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """grad^T @ x in float32, per block of `splits` blocks of rows and then over them; w's dtype."""
    (T, D), E = x_TD.shape, w_ED.shape[0]
    E_P = _experts_padded(E)
    launch = _launch("weight_grad", E_P)
    splits = max(1, min(launch.splits, cdiv(T, launch.block_t)))
    partial_SED = torch.empty(splits, E, D, dtype=torch.float32, device=x_TD.device)
    _kernels().weight_grad[(cdiv(D, launch.block_d), splits)](
        grad_TE, x_TD, partial_SED, T, D, E, cdiv(T, splits), zero=0.0, E_P=E_P, MATH=_pieces_against(x_TD),
        BLOCK_T=launch.block_t, BLOCK_D=launch.block_d, num_warps=launch.warps, num_stages=launch.stages)
    return partial_SED.sum(dim=0).to(w_ED.dtype)


def input_grad_launch_key(w_dtype: torch.dtype) -> str:
    """`_LAUNCHES` key of the input gradient: against a float32 w it runs 3xTF32."""
    return "input_grad" if w_dtype == torch.bfloat16 else "input_grad/tf32x3"


def _pieces_against(other: torch.Tensor) -> str:
    """The float32 logits gradient times `other`: in bf16 pieces when `other` is bf16."""
    return "bf16_pieces" if other.dtype == torch.bfloat16 else "tf32x3"


class _SoftmaxTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, k, bias_E, normalize):
        T, E = logits_TE.shape
        outputs, bias, has_bias = _routing_outputs(logits_TE, T, E, k, bias_E)
        _kernels().softmax_topk[(cdiv(T, _TOPK_BLOCK_T),)](
            logits_TE, bias, *outputs, T, E, K=k, K_P=next_pow2(k), E_P=_experts_padded(E), HAS_BIAS=has_bias,
            NORMALIZE=normalize, BLOCK_T=_TOPK_BLOCK_T)
        return _save_routing(ctx, outputs, normalize)

    @staticmethod
    def backward(ctx, grad_scores_TE, grad_gates_TK, _):
        return softmax_topk_backward(ctx, grad_scores_TE, grad_gates_TK), None, None, None


class _RouteSoftmaxTopK(torch.autograd.Function):
    """`_RouterLogits` then `_SoftmaxTopK`, forward in one launch; the backward is theirs."""

    @staticmethod
    def forward(ctx, x_TD, w_ED, k, bias_E, normalize):
        (T, D), E = x_TD.shape, w_ED.shape[0]
        outputs, bias, has_bias = _routing_outputs(x_TD, T, E, k, bias_E)
        E_P = _experts_padded(E)
        launch = _launch("logits", E_P)
        w_ED = w_ED.contiguous()
        _kernels().logits_softmax_topk[(cdiv(T, launch.block_t),)](
            x_TD, w_ED, bias, *outputs, T, D, E, zero=0.0, K=k, K_P=next_pow2(k), E_P=E_P, HAS_BIAS=has_bias,
            NORMALIZE=normalize, MATH=_logits_math(x_TD, w_ED), BLOCK_T=launch.block_t, BLOCK_D=launch.block_d,
            num_warps=launch.warps, num_stages=launch.stages)
        return _save_routing(ctx, outputs, normalize, x_TD, w_ED)

    @staticmethod
    def backward(ctx, grad_scores_TE, grad_gates_TK, _):
        grad_logits_TE = softmax_topk_backward(ctx, grad_scores_TE, grad_gates_TK)
        x_TD, w_ED = ctx.saved_tensors[3:]
        grad_x, grad_w = logits_backward(grad_logits_TE, x_TD, w_ED, *ctx.needs_input_grad[:2])
        return grad_x, grad_w, None, None, None


def _routing_outputs(like: torch.Tensor, T: int, E: int, k: int, bias_E: torch.Tensor | None):
    """((scores_TE, gates_TK, expert_idx_TK) to be written, the bias pointer, whether there is one)."""
    scores_TE = torch.empty(T, E, dtype=torch.float32, device=like.device)
    gates_TK = torch.empty(T, k, dtype=torch.float32, device=like.device)
    expert_idx_TK = torch.empty(T, k, dtype=torch.long, device=like.device)
    has_bias = bias_E is not None
    bias = bias_E.float().contiguous() if has_bias else scores_TE  # unread without a bias
    return (scores_TE, gates_TK, expert_idx_TK), bias, has_bias


def _save_routing(ctx, outputs, normalize: bool, *inputs: torch.Tensor):
    """Saves the outputs (then `inputs`) for the backward and returns the outputs."""
    ctx.save_for_backward(*outputs, *inputs)
    ctx.normalize = normalize
    ctx.mark_non_differentiable(outputs[2])
    return outputs


def softmax_topk_backward(ctx, grad_scores_TE, grad_gates_TK) -> torch.Tensor:
    """The logits' gradient from those of the scores and the gates (plain PyTorch: it runs
    while the expert GEMMs do)."""
    scores_TE, gates_TK, expert_idx_TK = ctx.saved_tensors[:3]
    grad_TE = torch.zeros_like(scores_TE) if grad_scores_TE is None else grad_scores_TE.clone()
    if grad_gates_TK is not None:
        grad_chosen_TK = grad_gates_TK
        if ctx.normalize:  # gates = s / Z: d s_j = (g_j - sum_k g_k gates_k) / Z
            chosen_TK = scores_TE.gather(1, expert_idx_TK)
            total_T1 = chosen_TK.sum(dim=-1, keepdim=True) + 1e-20
            grad_chosen_TK = (grad_gates_TK - (grad_gates_TK * gates_TK).sum(-1, keepdim=True)) / total_T1
        grad_TE.scatter_add_(1, expert_idx_TK, grad_chosen_TK)
    return scores_TE * (grad_TE - (grad_TE * scores_TE).sum(dim=-1, keepdim=True))


# ---- Triton --------------------------------------------------------------------------------------

_Launch = namedtuple("_Launch", "block_t block_d warps stages splits", defaults=(1,))
# Per kernel, (largest padded expert count, launch) in increasing order; the last one covers the
# rest. Chosen by measurement on an H100 (`bench/router_kernels.py --sweep`: 16 experts padded
# from the Mixtral-like 8, 128 the Qwen3-like): the fastest over bf16 and float32 router weights.
# The input gradient against a float32 w ("tf32x3") has a launch of its own. weight_grad's
# `splits` blocks of rows are summed after the kernel; it and block_t fix the order of that sum.
_LAUNCHES = {
    "logits": [(16, _Launch(64, 128, warps=4, stages=4)), (1 << 30, _Launch(128, 64, warps=8, stages=4))],
    "input_grad": [(16, _Launch(32, 128, warps=4, stages=3)), (1 << 30, _Launch(128, 128, warps=8, stages=3))],
    "input_grad/tf32x3": [(16, _Launch(32, 128, warps=4, stages=3)), (1 << 30, _Launch(32, 64, warps=4, stages=3))],
    "weight_grad": [(16, _Launch(64, 128, warps=4, stages=3, splits=8)),
                    (1 << 30, _Launch(64, 128, warps=8, stages=3, splits=8))],
}
_TOPK_BLOCK_T = 32


def _launch(kernel: str, E_P: int) -> _Launch:
    return next(launch for most, launch in _LAUNCHES[kernel] if E_P <= most)


def _kernels():
    """The Triton kernels (`dyad/kernels/moe_router_triton.py`: logits, input_grad, weight_grad,
    softmax_topk), or None without Triton."""
    return triton_module("moe_router_triton")
