"""Token permutation for dropless MoE: gather token copies into expert-major order and back.

Legend: T tokens, K experts per token (top-k), N = T*K assignments, D model dim, E experts.

An assignment is identified by its flat index t*K + k. `permute` stable-sorts assignments by
expert id, so within an expert the assignments keep token order and the layout is deterministic.
`unpermute` inverts that order, weights each copy by its gate and sums the K copies of a token.
The `*_reference` versions compute the same thing with plain Python loops.
"""

import torch


def expert_counts(flat_expert_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, int64 [E]: `bincount(minlength=E)` with a shape that does not
    depend on the values (so torch.compile traces it without a graph break)."""
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=flat_expert_N.device)
    return counts_E.scatter_add_(0, flat_expert_N, torch.ones_like(flat_expert_N, dtype=torch.long))


def permute(
    x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (x_sorted_ND, sorted_order_N, counts_E); sorted_order_N[i] is a flat t*K + k."""
    K = expert_idx_TK.shape[1]
    flat_expert_N = expert_idx_TK.reshape(-1)
    sorted_order_N = torch.argsort(flat_expert_N, stable=True)
    counts_E = expert_counts(flat_expert_N, num_experts)
    x_sorted_ND = _GatherCopies.apply(x_TD, sorted_order_N, K)
    return x_sorted_ND, sorted_order_N, counts_E


def unpermute(y_sorted_ND: torch.Tensor, sorted_order_N: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum_k gates[t, k] * (row of y_sorted that came from assignment t*K + k)."""
    return _CombineCopies.apply(y_sorted_ND, sorted_order_N, gates_TK)


def _inverse(sorted_order_N: torch.Tensor) -> torch.Tensor:
    """Where each flat assignment t*K + k sits in expert-major order."""
    positions_N = torch.arange(sorted_order_N.shape[0], device=sorted_order_N.device)
    return torch.empty_like(sorted_order_N).scatter_(0, sorted_order_N, positions_N)


def _copies_TKD(sorted_ND: torch.Tensor, sorted_order_N: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """The K rows of each token, gathered back into token order."""
    return sorted_ND.index_select(0, _inverse(sorted_order_N)).view(T, K, sorted_ND.shape[1])


class _GatherCopies(torch.autograd.Function):
    """x_sorted = x[order // K]. The backward sums each token's K gradient rows by gathering
    them into token order (float32 sum), not by index_add's atomics: deterministic, and several
    times faster on a GPU when K copies of a token collide."""

    @staticmethod
    def forward(ctx, x_TD, sorted_order_N, K):
        ctx.save_for_backward(sorted_order_N)
        ctx.T, ctx.K = x_TD.shape[0], K
        return x_TD.index_select(0, sorted_order_N // K)

    @staticmethod
    def backward(ctx, grad_sorted_ND):
        (sorted_order_N,) = ctx.saved_tensors
        grad_TKD = _copies_TKD(grad_sorted_ND, sorted_order_N, ctx.T, ctx.K)
        return grad_TKD.sum(dim=1, dtype=torch.float32).to(grad_sorted_ND.dtype), None, None


def _gated_sum_TD(gates_TK: torch.Tensor, y_TKD: torch.Tensor) -> torch.Tensor:
    """sum_k gates[t, k] * y[t, k], accumulated in float32, in y's dtype; the gates enter in y's
    dtype (as a bf16 matmul's operands would). Eagerly one batched (1 x K) @ (K x D) product per
    token (no float32 copy of the K rows); traced, products and sum in float32 (bf16 products
    are exact there), which inductor fuses with the gather into one reduction."""
    gates_TK = gates_TK.to(y_TKD.dtype)
    if torch.compiler.is_compiling():
        return (gates_TK.float().unsqueeze(2) * y_TKD.float()).sum(1).to(y_TKD.dtype)
    return torch.bmm(gates_TK.unsqueeze(1), y_TKD).squeeze(1)


def _row_dots_TK(y_TKD: torch.Tensor, grad_TD: torch.Tensor) -> torch.Tensor:
    """<y[t, k], grad[t]> for every k, accumulated in float32, rounded to y's dtype (the same
    choice of kernels as `_gated_sum_TD`)."""
    if torch.compiler.is_compiling():
        return (y_TKD.float() * grad_TD.float().unsqueeze(1)).sum(2).to(y_TKD.dtype)
    return torch.bmm(y_TKD, grad_TD.unsqueeze(2)).squeeze(2)


class _CombineCopies(torch.autograd.Function):
    """y[t] = sum_k gates[t, k] * y_sorted[position of t*K + k] (see `_gated_sum_TD`)."""

    @staticmethod
    def forward(ctx, y_sorted_ND, sorted_order_N, gates_TK):
        T, K = gates_TK.shape
        ctx.save_for_backward(y_sorted_ND, sorted_order_N, gates_TK)
        return _gated_sum_TD(gates_TK, _copies_TKD(y_sorted_ND, sorted_order_N, T, K))

    @staticmethod
    def backward(ctx, grad_TD):
        y_sorted_ND, sorted_order_N, gates_TK = ctx.saved_tensors
        T, K = gates_TK.shape
        grad_TD = grad_TD.contiguous()
        grad_y_sorted = grad_gates = None
        if ctx.needs_input_grad[0]:
            row_gates_N = gates_TK.reshape(-1).index_select(0, sorted_order_N).to(grad_TD.dtype)
            grad_y_sorted = grad_TD.index_select(0, sorted_order_N // K) * row_gates_N.unsqueeze(1)
        if ctx.needs_input_grad[2]:
            y_TKD = _copies_TKD(y_sorted_ND, sorted_order_N, T, K)
            grad_gates = _row_dots_TK(y_TKD, grad_TD).to(gates_TK.dtype)
        return grad_y_sorted, None, grad_gates


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
