"""Token permutation for dropless MoE: gather token copies into expert-major order and back.

Legend: T tokens, K experts per token (top-k), N = T*K assignments, D model dim, E experts.

An assignment is identified by its flat index t*K + k. `permute` stable-sorts assignments by
expert id, so within an expert the assignments keep token order and the layout is deterministic.
`unpermute` inverts that order, weights each copy by its gate and sums the K copies of a token.
The `*_reference` versions compute the same thing with plain Python loops.
"""

import torch


def permute(
    x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (x_sorted_ND, sorted_order_N, counts_E); sorted_order_N[i] is a flat t*K + k."""
    K = expert_idx_TK.shape[1]
    flat_expert_N = expert_idx_TK.reshape(-1)
    sorted_order_N = torch.argsort(flat_expert_N, stable=True)
    counts_E = torch.bincount(flat_expert_N, minlength=num_experts)
    x_sorted_ND = x_TD.index_select(0, sorted_order_N // K)
    return x_sorted_ND, sorted_order_N, counts_E


def unpermute(y_sorted_ND: torch.Tensor, sorted_order_N: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum_k gates[t, k] * (row of y_sorted that came from assignment t*K + k)."""
    T, K = gates_TK.shape
    D = y_sorted_ND.shape[1]
    N = sorted_order_N.shape[0]
    positions_N = torch.arange(N, device=sorted_order_N.device)
    inverse_order_N = torch.empty_like(sorted_order_N).scatter_(0, sorted_order_N, positions_N)
    y_TKD = y_sorted_ND.index_select(0, inverse_order_N).view(T, K, D)
    # Sum the K weighted copies in float32 (gates come from a float32 router).
    y_TD = (y_TKD.float() * gates_TK.float().unsqueeze(-1)).sum(dim=1)
    return y_TD.to(y_sorted_ND.dtype)


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
