"""Each token's K expert rows, gathered and reduced in one pass: the heavy part of unpermute
(combine) forward and backward and of permute's backward.

Legend: T tokens, K experts per token, N = T*K rows in expert-major order, D model dim;
positions_TK[t, k] is the row (in expert-major order) of assignment t*K + k.

- `gathered_sum(rows_ND, positions_TK, weights_TK=None, out_dtype=None)`: y[t] = sum_k w[t, k] *
  rows[pos[t, k]] (w = 1 without weights), accumulated in float32, rounded once to `out_dtype`
  (default the rows' dtype); weights enter in the rows' dtype, as a bf16 matmul's operands would.
- `scaled_scatter_and_dots(grad_TD, rows_ND, positions_TK, weights_TK)`: the backward of the
  weighted sum, (grad_rows_ND with grad_rows[pos[t, k]] = w[t, k] * grad[t] rounded to the
  dtype, dots_TK = <rows[pos[t, k]], grad[t]> accumulated in float32 and rounded to the rows'
  dtype, as the bmm that computes them eagerly rounds).
- `scattered_copies(x_TD, positions_TK, order_N, out_dtype)`: the K copies of each token in
  expert-major order, rows[pos[t, k]] = x[t] in `out_dtype` (order_N: the flat assignment t*K + k
  of each row, the inverse of the positions; the reference gathers by it). Exact either way: a
  copy, or one rounding of each element to `out_dtype`.

Eagerly PyTorch needs a gather of all N rows into token order (N x D written and read again)
and a batched matmul for each; one Triton program per token here reads each row once and writes
only the result. The copies' gather reads a token's row once for each of its K copies (traced,
an inductor kernel that also casts each time: 0.56 ms for the 1.07 GB of copies of 32,768
tokens, top-8, on an H200); the scatter reads it once. The `*_reference` functions are the same
math in plain PyTorch (index_select and bmm); they run off CUDA, without Triton and in float32
(float32 runs check the math, eager against compiled among others, so they keep eager PyTorch's
kernels).

Under torch.compile the Triton kernels run as custom ops (`dyad::gathered_sum`,
`dyad::scaled_scatter_and_dots`, `dyad::scattered_copies`), which the compiler keeps whole in
its graph: traced, the reference's gather and reduction became inductor kernels that moved the
rows at a quarter of the bandwidth these reach (a compiled LLM step of 32 experts, top-8, spent
79 ms of 640 in them).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from dyad.kernels.launch_sizes import next_pow2
from dyad.kernels.traceable import to_dtype

_BLOCK_D = 1024
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


# ---- plain PyTorch -------------------------------------------------------------------------------


def gathered_sum_reference(rows_ND, positions_TK, weights_TK=None, out_dtype=None):
    T, K = positions_TK.shape
    out_dtype = out_dtype or rows_ND.dtype
    rows_TKD = rows_ND.index_select(0, positions_TK.reshape(-1)).view(T, K, rows_ND.shape[1])
    if weights_TK is None:
        return to_dtype(rows_TKD.sum(dim=1, dtype=torch.float32), out_dtype)
    weights_TK = weights_TK.to(rows_ND.dtype)
    if torch.compiler.is_compiling() or out_dtype != rows_ND.dtype:  # bf16 products are exact in float32
        return to_dtype((weights_TK.float().unsqueeze(2) * rows_TKD.float()).sum(1), out_dtype)
    return torch.bmm(weights_TK.unsqueeze(1), rows_TKD).squeeze(1)  # float32 accumulation


def scaled_scatter_and_dots_reference(grad_TD, rows_ND, positions_TK, weights_TK):
    T, K = positions_TK.shape
    order_N = _order(positions_TK)  # the flat assignment t*K + k of each row
    row_weights_N = weights_TK.reshape(-1).index_select(0, order_N).to(grad_TD.dtype)
    grad_rows_ND = grad_TD.index_select(0, order_N // K) * row_weights_N.unsqueeze(1)
    rows_TKD = rows_ND.index_select(0, positions_TK.reshape(-1)).view(T, K, rows_ND.shape[1])
    if torch.compiler.is_compiling():
        dots_TK = to_dtype((rows_TKD.float() * grad_TD.float().unsqueeze(1)).sum(2), rows_ND.dtype)
    else:
        dots_TK = torch.bmm(rows_TKD, grad_TD.unsqueeze(2)).squeeze(2)
    return grad_rows_ND, dots_TK


def scattered_copies_reference(x_TD, positions_TK, order_N, out_dtype):
    return to_dtype(x_TD, out_dtype).index_select(0, order_N // positions_TK.shape[1])


def _order(positions_TK: torch.Tensor) -> torch.Tensor:
    flat_N = torch.arange(positions_TK.numel(), device=positions_TK.device)
    return torch.empty_like(flat_N).scatter_(0, positions_TK.reshape(-1), flat_N)


# ---- dispatch ------------------------------------------------------------------------------------


def gathered_sum(rows_ND, positions_TK, weights_TK=None, out_dtype=None):
    if not _fused_applies(rows_ND, positions_TK):
        return gathered_sum_reference(rows_ND, positions_TK, weights_TK, out_dtype)
    out_dtype = out_dtype or rows_ND.dtype
    if weights_TK is not None:
        weights_TK = weights_TK.to(rows_ND.dtype)
    if torch.compiler.is_compiling():
        return _gathered_sum_op(rows_ND, positions_TK, weights_TK, out_dtype)
    return _gathered_sum_fused(rows_ND, positions_TK, weights_TK, out_dtype)


def scaled_scatter_and_dots(grad_TD, rows_ND, positions_TK, weights_TK):
    if not _fused_applies(rows_ND, positions_TK) or grad_TD.dtype != rows_ND.dtype:
        return scaled_scatter_and_dots_reference(grad_TD, rows_ND, positions_TK, weights_TK)
    weights_TK = weights_TK.to(rows_ND.dtype)
    if torch.compiler.is_compiling():
        return _scaled_scatter_and_dots_op(grad_TD, rows_ND, positions_TK, weights_TK)
    return _scaled_scatter_and_dots_fused(grad_TD, rows_ND, positions_TK, weights_TK)


def scattered_copies(x_TD, positions_TK, order_N, out_dtype):
    # x may be float32 (a float32 residual stream), cast by the kernel; float32 copies: the reference
    if not (out_dtype in _LOW_PRECISION and x_TD.dtype in (out_dtype, torch.float32)
            and _kernel_takes(x_TD, positions_TK)):
        return scattered_copies_reference(x_TD, positions_TK, order_N, out_dtype)
    if torch.compiler.is_compiling():
        return _scattered_copies_op(x_TD, positions_TK, out_dtype)
    return _scattered_copies_fused(x_TD, positions_TK, out_dtype)


def _fused_applies(rows_ND: torch.Tensor, positions_TK: torch.Tensor) -> bool:
    """Where the Triton kernels run (float32 rows: see the module docstring)."""
    return rows_ND.dtype in _LOW_PRECISION and _kernel_takes(rows_ND, positions_TK)


def _kernel_takes(rows_ND: torch.Tensor, positions_TK: torch.Tensor) -> bool:
    """Whether a kernel can take these operands; traced, what the custom ops make contiguous."""
    traced = torch.compiler.is_compiling()
    return (
        rows_ND.is_cuda
        and rows_ND.dim() == 2
        and (traced or (rows_ND.is_contiguous() and positions_TK.is_contiguous() and positions_TK.numel() > 0))
        and _HAVE_TRITON  # (not `_kernels()`: a cached function's call would break dynamo's graph)
    )


def _gathered_sum_fused(rows_ND, positions_TK, weights_TK, out_dtype):
    """The Triton kernel's launch; weights already in the rows' dtype."""
    T, K = positions_TK.shape
    D = rows_ND.shape[1]
    out_TD = rows_ND.new_empty(T, D, dtype=out_dtype)
    if T == 0:
        return out_TD
    weighted = weights_TK is not None
    weights = weights_TK.contiguous() if weighted else rows_ND  # unread if not
    kernel, _ = _kernels()
    kernel[(T,)](rows_ND, positions_TK, weights, out_TD, D, K=K, K_P2=next_pow2(K),
                 WEIGHTED=weighted, BLOCK_D=_BLOCK_D)
    return out_TD


def _scaled_scatter_and_dots_fused(grad_TD, rows_ND, positions_TK, weights_TK):
    T, K = positions_TK.shape
    D = rows_ND.shape[1]
    grad_rows_ND = torch.empty_like(rows_ND)
    dots_TK = torch.empty(T, K, dtype=torch.float32, device=rows_ND.device)
    if T == 0:
        return grad_rows_ND, dots_TK.to(rows_ND.dtype)
    _, kernel = _kernels()
    kernel[(T,)](grad_TD.contiguous(), rows_ND, positions_TK, weights_TK.contiguous(),
                 grad_rows_ND, dots_TK, D, K=K, K_P2=next_pow2(K), BLOCK_D=_BLOCK_D)
    return grad_rows_ND, dots_TK.to(rows_ND.dtype)


def _scattered_copies_fused(x_TD, positions_TK, out_dtype):
    T, K = positions_TK.shape
    D = x_TD.shape[1]
    out_ND = x_TD.new_empty(T * K, D, dtype=out_dtype)
    if T == 0:
        return out_ND
    kernel = _copy_kernel()
    kernel[(T,)](x_TD, positions_TK, out_ND, D, K=K, K_P2=next_pow2(K), BLOCK_D=_BLOCK_D)
    return out_ND


# What torch.compile calls: custom ops it keeps whole (their autograd is the MoE permutation's
# autograd.Functions', so none is registered here).
@torch.library.custom_op("dyad::gathered_sum", mutates_args=())
def _gathered_sum_op(
    rows_ND: torch.Tensor, positions_TK: torch.Tensor, weights_TK: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    return _gathered_sum_fused(rows_ND.contiguous(), positions_TK.contiguous(), weights_TK, out_dtype)


@_gathered_sum_op.register_fake
def _(rows_ND, positions_TK, weights_TK, out_dtype):
    return rows_ND.new_empty(positions_TK.shape[0], rows_ND.shape[1], dtype=out_dtype)


@torch.library.custom_op("dyad::scaled_scatter_and_dots", mutates_args=())
def _scaled_scatter_and_dots_op(
    grad_TD: torch.Tensor, rows_ND: torch.Tensor, positions_TK: torch.Tensor, weights_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _scaled_scatter_and_dots_fused(grad_TD, rows_ND.contiguous(), positions_TK.contiguous(), weights_TK)


@_scaled_scatter_and_dots_op.register_fake
def _(grad_TD, rows_ND, positions_TK, weights_TK):
    return rows_ND.new_empty(rows_ND.shape), rows_ND.new_empty(positions_TK.shape)


@torch.library.custom_op("dyad::scattered_copies", mutates_args=())
def _scattered_copies_op(x_TD: torch.Tensor, positions_TK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _scattered_copies_fused(x_TD.contiguous(), positions_TK.contiguous(), out_dtype)


@_scattered_copies_op.register_fake
def _(x_TD, positions_TK, out_dtype):
    return x_TD.new_empty(positions_TK.numel(), x_TD.shape[1], dtype=out_dtype)


@functools.cache
def _copy_kernel():
    """The `scattered_copies` Triton kernel (Triton is there: `_kernel_takes` asked)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows(x_ptr, pos_ptr, out_ptr, D, K: tl.constexpr, K_P2: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K_P2)
        has_k = k < K
        pos = tl.load(pos_ptr + t * K + k, mask=has_k, other=0).to(tl.int64)
        for start in range(0, D, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)
            row = tl.load(x_ptr + t * D + d, mask=d < D, other=0.0).to(out_ptr.dtype.element_ty)
            copies = tl.broadcast_to(row[None, :], (K_P2, BLOCK_D))
            tl.store(out_ptr + pos[:, None] * D + d[None, :], copies, mask=has_k[:, None] & (d[None, :] < D))

    return copy_rows


@functools.cache
def _kernels():
    """(gathered_sum, scaled_scatter_and_dots) Triton kernels, or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def sum_rows(rows_ptr, pos_ptr, w_ptr, out_ptr, D, K: tl.constexpr, K_P2: tl.constexpr,
                 WEIGHTED: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K_P2)
        has_k = k < K
        pos = tl.load(pos_ptr + t * K + k, mask=has_k, other=0).to(tl.int64)
        if WEIGHTED:
            w = tl.load(w_ptr + t * K + k, mask=has_k, other=0.0).to(tl.float32)
        for start in range(0, D, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)
            inside = has_k[:, None] & (d[None, :] < D)
            rows = tl.load(rows_ptr + pos[:, None] * D + d[None, :], mask=inside, other=0.0).to(tl.float32)
            if WEIGHTED:
                rows = rows * w[:, None]
            tl.store(out_ptr + t * D + d, tl.sum(rows, axis=0).to(out_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def scatter_and_dots(grad_ptr, rows_ptr, pos_ptr, w_ptr, grad_rows_ptr, dots_ptr, D,
                         K: tl.constexpr, K_P2: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K_P2)
        has_k = k < K
        pos = tl.load(pos_ptr + t * K + k, mask=has_k, other=0).to(tl.int64)
        w = tl.load(w_ptr + t * K + k, mask=has_k, other=0.0).to(tl.float32)
        dots = tl.zeros((K_P2,), dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)
            inside = has_k[:, None] & (d[None, :] < D)
            grad = tl.load(grad_ptr + t * D + d, mask=d < D, other=0.0).to(tl.float32)
            at = pos[:, None] * D + d[None, :]
            rows = tl.load(rows_ptr + at, mask=inside, other=0.0).to(tl.float32)
            dots += tl.sum(rows * grad[None, :], axis=1)
            scaled = (w[:, None] * grad[None, :]).to(grad_rows_ptr.dtype.element_ty)
            tl.store(grad_rows_ptr + at, scaled, mask=inside)
        tl.store(dots_ptr + t * K + k, dots, mask=has_k)

    return sum_rows, scatter_and_dots
