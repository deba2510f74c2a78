"""Token permutation for dropless MoE: gather token copies into expert-major order and back.

Legend: T tokens, K experts per token (top-k), N = T*K assignments, D model dim, E experts.

An assignment is identified by its flat index t*K + k. `permute` stable-sorts assignments by
expert id, so within an expert the assignments keep token order and the layout is deterministic.
`unpermute` inverts that order, weights each copy by its gate and sums the K copies of a token.
The `*_reference` versions compute the same thing with plain Python loops.

The plan (each assignment's row in expert-major order, and the rows of each expert) is
`expert_plan`: on CUDA one Triton launch (`dyad/kernels/moe_permute_triton.py`) where the plain path
launches about eight kernels (a cast, the radix sort's, the counts' zeros and scatter) before the
first expert GEMM, where a step that starts from an idle GPU waits on the host's launches. Each
of its programs reads every id, so its time grows with the assignments faster than the plain
ops' does: past `_PLAN_MAX_ROWS` the plain ops run.
"""

import torch

from dyad.kernels.grouped_mm import matmul_dtype
from dyad.kernels.token_rows import gathered_sum, scaled_scatter_and_dots, scattered_copies
from dyad.kernels.triton_modules import triton_module

_PLAN_BLOCK = 4096  # ids per step of a plan program; its scan runs over one block
_PLAN_MAX_ROWS = 32_768  # about where the plain ops overtake the Triton plan on a GPU (between 16k and 131k)


def expert_counts(flat_expert_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, int64 [E]: `bincount(minlength=E)` with a shape that does not
    depend on the values (so torch.compile traces it without a graph break)."""
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=flat_expert_N.device)
    return counts_E.scatter_add_(0, flat_expert_N, torch.ones_like(flat_expert_N, dtype=torch.long))


def stable_expert_order(ids_N: torch.Tensor, num_ids: int) -> torch.Tensor:
    """`argsort(ids_N, stable=True)` for ids in [0, num_ids), sorted as the narrowest integer
    type that holds them: a GPU radix sort makes one pass per byte of key, eight for the int64
    ids that top-k returns, one for uint8."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if num_ids - 1 <= torch.iinfo(dtype).max:
            return torch.argsort(ids_N.to(dtype), stable=True)
    return torch.argsort(ids_N, stable=True)


def expert_plan(flat_expert_N: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_order_N, counts_E): `stable_expert_order(flat_expert_N, num_experts)` and
    `expert_counts(flat_expert_N, num_experts)`, the same values; on CUDA in one launch."""
    if not _plan_kernel_applies(flat_expert_N):
        return stable_expert_order(flat_expert_N, num_experts), expert_counts(flat_expert_N, num_experts)
    N = flat_expert_N.shape[0]
    sorted_order_N = torch.empty(N, dtype=torch.long, device=flat_expert_N.device)
    counts_E = torch.empty(num_experts, dtype=torch.long, device=flat_expert_N.device)
    _kernels().expert_plan[(num_experts,)](flat_expert_N, sorted_order_N, counts_E, N, BLOCK=_PLAN_BLOCK, num_warps=8)
    return sorted_order_N, counts_E


def _plan_kernel_applies(flat_expert_N: torch.Tensor) -> bool:
    # Compiling is asked first: a compiled graph never runs the kernel, and asking the row count
    # there would guard the graph on it (a recompile each time a microbatch crosses the bound).
    return (
        not torch.compiler.is_compiling()
        and flat_expert_N.is_cuda
        and flat_expert_N.dim() == 1
        and flat_expert_N.is_contiguous()
        and flat_expert_N.shape[0] <= _PLAN_MAX_ROWS
        and _kernels() is not None
    )


def _kernels():
    """The Triton kernel (`dyad/kernels/moe_permute_triton.py`), or None without Triton."""
    return triton_module("moe_permute_triton")


def permute(
    x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (x_sorted_ND, sorted_order_N, counts_E); sorted_order_N[i] is a flat t*K + k.
    The copies are in the dtype the experts' matmuls take them in (`matmul_dtype`: autocast's
    bf16 for a float32 x), cast before they are gathered, so that the K copies, and their
    gradients on the way back, move in bf16; the gradient of x is summed in float32 and rounded
    to x's dtype once, as the matmul's cast and a float32 sum of the copies would give it."""
    K = expert_idx_TK.shape[1]
    flat_expert_N = expert_idx_TK.reshape(-1)
    sorted_order_N, counts_E = expert_plan(flat_expert_N, num_experts)
    x_sorted_ND = _GatherCopies.apply(x_TD, sorted_order_N, K, matmul_dtype(x_TD))
    return x_sorted_ND, sorted_order_N, counts_E


def unpermute(y_sorted_ND: torch.Tensor, sorted_order_N: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum_k gates[t, k] * (row of y_sorted that came from assignment t*K + k)."""
    return _CombineCopies.apply(y_sorted_ND, sorted_order_N, gates_TK)


def _positions_TK(sorted_order_N: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """Where each assignment t*K + k sits in expert-major order, as [T, K]."""
    return inverse_permutation(sorted_order_N).view(T, K)


def inverse_permutation(order_N: torch.Tensor) -> torch.Tensor:
    """inverse_N with inverse_N[order_N[i]] = i, for a permutation `order_N` of range(N)."""
    flat_N = torch.arange(order_N.shape[0], device=order_N.device)
    return torch.empty_like(order_N).scatter_(0, order_N, flat_N)


def permute_rows(x_MD: torch.Tensor, order_M: torch.Tensor, inverse_M: torch.Tensor) -> torch.Tensor:
    """x_MD[order_M] for a permutation `order_M` of the rows and its inverse `inverse_M`.

    The gradient is a gather by the inverse: autograd's own backward of `index_select` adds the
    rows into zeros with `index_add_`, whose atomics are several times slower than the gather.
    The same values: a permutation adds nothing."""
    return _PermuteRows.apply(x_MD, order_M, inverse_M)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, order_M, inverse_M):
        ctx.save_for_backward(inverse_M)
        return x_MD.index_select(0, order_M)

    @staticmethod
    def backward(ctx, grad_MD):
        (inverse_M,) = ctx.saved_tensors
        return grad_MD.index_select(0, inverse_M), None, None


class _GatherCopies(torch.autograd.Function):
    """x_sorted = x[order // K] in `dtype` (`scattered_copies`: on CUDA each token's row read once
    and written to its K places). The backward sums each token's K gradient rows in token order
    (float32 sum, `gathered_sum`) into x's dtype, not by index_add's atomics: deterministic, and
    several times faster on a GPU when K copies of a token collide."""

    @staticmethod
    def forward(ctx, x_TD, sorted_order_N, K, dtype):
        positions_TK = _positions_TK(sorted_order_N, x_TD.shape[0], K)
        ctx.save_for_backward(positions_TK)
        ctx.x_dtype = x_TD.dtype
        return scattered_copies(x_TD, positions_TK, sorted_order_N, dtype)

    @staticmethod
    def backward(ctx, grad_sorted_ND):
        (positions_TK,) = ctx.saved_tensors
        return gathered_sum(grad_sorted_ND.contiguous(), positions_TK, out_dtype=ctx.x_dtype), None, None, None


class _CombineCopies(torch.autograd.Function):
    """y[t] = sum_k gates[t, k] * y_sorted[position of t*K + k], accumulated in float32 with the
    gates in y's dtype (as a bf16 matmul's operands would be), rounded once (`gathered_sum`)."""

    @staticmethod
    def forward(ctx, y_sorted_ND, sorted_order_N, gates_TK):
        T, K = gates_TK.shape
        positions_TK = _positions_TK(sorted_order_N, T, K)
        y_sorted_ND = y_sorted_ND.contiguous()
        ctx.save_for_backward(y_sorted_ND, positions_TK, gates_TK)
        return gathered_sum(y_sorted_ND, positions_TK, gates_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        y_sorted_ND, positions_TK, gates_TK = ctx.saved_tensors
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[2]):
            return None, None, None
        grad_y_sorted, dots_TK = scaled_scatter_and_dots(grad_TD, y_sorted_ND, positions_TK, gates_TK)
        grad_gates = dots_TK.to(gates_TK.dtype) if ctx.needs_input_grad[2] else None
        return (grad_y_sorted if ctx.needs_input_grad[0] else None), None, grad_gates


def permute_reference(
    x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, K = expert_idx_TK.shape
    ids = expert_idx_TK.tolist()
    order = [t * K + k for e in range(num_experts) for t in range(T) for k in range(K) if ids[t][k] == e]
    counts = [sum(row.count(e) for row in ids) for e in range(num_experts)]
    rows = [x_TD[flat // K] for flat in order]
    x_sorted_ND = torch.stack(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])
    device = expert_idx_TK.device
    return x_sorted_ND, torch.tensor(order, dtype=torch.long, device=device), torch.tensor(counts, device=device)


def unpermute_reference(y_sorted_ND: torch.Tensor, sorted_order_N: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
    T, K = gates_TK.shape
    rows = [y_sorted_ND.new_zeros(y_sorted_ND.shape[1], dtype=torch.float32) for _ in range(T)]
    for i, flat in enumerate(sorted_order_N.tolist()):
        t, k = divmod(flat, K)
        rows[t] = rows[t] + gates_TK[t, k].float() * y_sorted_ND[i].float()
    y_TD = torch.stack(rows) if rows else y_sorted_ND.new_zeros(0, y_sorted_ND.shape[1], dtype=torch.float32)
    return y_TD.to(y_sorted_ND.dtype)
