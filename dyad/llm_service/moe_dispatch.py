"""Token dispatchers for expert parallelism: send every token-expert assignment to the rank that owns
its expert, and the expert outputs back.

Legend: T tokens on this rank, K experts per token, N = T*K assignments, D model dim, E experts,
L = E/ep local experts, M rows this rank's local experts compute, P ep ranks, Q etp ranks.

Ownership: ep rank p owns experts [p*L, (p+1)*L). With expert tensor parallelism the Q ranks of an
etp group own the same experts, each a 1/Q slice of the ffn dim, so every one of them computes a
partial output for the rows of the whole etp group; the partials are summed back to the rank that
holds the token. Group ranks (`dist.get_rank(group)`) are the ep / etp indices.

Every dispatcher has one interface:

    x_local_MD, counts_L, handle = d.dispatch(x_TD, expert_idx_TK)   # rows local-expert-major
    y_TD = d.combine(y_local_MD, gates_TK, handle)                   # gate-weighted sum of copies

`LocalDispatcher` is the single-device reference (permute / unpermute), the MoE layer's own
`dispatcher`. `AllToAllDispatcher` sends each assignment only to its expert's rank.
`AllGatherDispatcher` gathers every token to every rank and keeps the rows of local experts: more
traffic, simpler, and the parity reference for all-to-all. Expert parallelism puts either in the
layer (`ExpertParallel`, dyad/llm_service/expert_parallel.py). Split sizes reach the host once per
dispatch (one `.tolist()`). Every step is differentiable: the collectives are
`dyad/parallel/collectives.py`'s autograd family (all-to-all <-> reversed all-to-all, all-gather
<-> reduce-scatter). Dropped assignments (gate 0) travel like any other.

Under torch.compile the expert-parallel dispatchers run eagerly (`torch.compiler.disable`): their
split sizes come to the host, so dynamo would break the graph there anyway and specialize the
pieces after the break on the sizes' values, recompiling them as the sizes change from one
microbatch to the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dyad.kernels.moe_permute import (
    expert_counts,
    inverse_permutation,
    permute,
    permute_rows,
    stable_expert_order,
    unpermute,
)
from dyad.parallel.collectives import (
    all_gather_rows,
    all_gather_sum_grad,
    all_to_all,
    group_rank,
    group_size,
    reduce_scatter_to_group,
)


def _gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """[...] -> [group size, ...], no autograd (integer metadata)."""
    if group_size(group) == 1:
        return counts.unsqueeze(0)
    return all_gather_rows(counts.reshape(-1), group).view(group_size(group), *counts.shape)


# ---- dispatchers ---------------------------------------------------------------------------------


@dataclass
class LocalHandle:
    sorted_order_N: torch.Tensor


class LocalDispatcher(nn.Module):
    """Single device: every expert is local. The reference the parallel dispatchers must equal."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def dispatch(self, x_TD, expert_idx_TK):
        x_sorted_ND, sorted_order_N, counts_E = permute(x_TD, expert_idx_TK, self.num_experts)
        return x_sorted_ND, counts_E, LocalHandle(sorted_order_N)

    def combine(self, y_sorted_ND, gates_TK, handle: LocalHandle):
        return unpermute(y_sorted_ND, handle.sorted_order_N, gates_TK)


@dataclass
class AllToAllHandle:
    sorted_order_N: torch.Tensor  # permute's order: destination-rank-major, then expert
    send_splits: list[int]  # rows to each ep rank
    recv_splits: list[int]  # rows from each ep rank
    etp_sizes: list[int]  # rows each etp rank received over ep
    expert_order_M: torch.Tensor  # (etp rank, ep rank, local expert)-major rows -> local-expert-major
    expert_inverse_M: torch.Tensor  # and back


class _ExpertParallelDispatcher:
    def __init__(self, ep_group: dist.ProcessGroup, num_experts: int, etp_group: dist.ProcessGroup | None = None):
        self.ep_group, self.etp_group, self.num_experts = ep_group, etp_group, num_experts
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        self.num_local = num_experts // self.ep  # dyad.layout.validate_llm_layout checks that ep divides


class AllToAllDispatcher(_ExpertParallelDispatcher):
    """counts all-to-all -> one host sync -> permute by destination -> variable all-to-all over ep ->
    all-gather over etp -> sort to local-expert-major; combine runs the inverse path."""

    @torch.compiler.disable
    def dispatch(self, x_TD, expert_idx_TK):
        P, Q, L = self.ep, self.etp, self.num_local
        # Experts are numbered rank-major, so permute's expert-major order is also destination-major.
        x_sorted_ND, sorted_order_N, counts_E = permute(x_TD, expert_idx_TK, self.num_experts)
        recv_counts_PL = counts_E.view(P, L)
        if P > 1:
            recv_counts_PL = torch.empty_like(recv_counts_PL)
            dist.all_to_all_single(recv_counts_PL, counts_E.view(P, L), group=self.ep_group)
        counts_QPL = _gather_counts(recv_counts_PL, self.etp_group)
        host = torch.cat([counts_E, counts_QPL.reshape(-1)]).tolist()  # the one device-to-host sync
        send_counts, grid = host[: P * L], host[P * L :]
        send_splits = [sum(send_counts[p * L : (p + 1) * L]) for p in range(P)]
        etp_rows = [grid[q * P * L : (q + 1) * P * L] for q in range(Q)]
        etp_rank = group_rank(self.etp_group)
        recv_splits = [sum(etp_rows[etp_rank][p * L : (p + 1) * L]) for p in range(P)]
        etp_sizes = [sum(rows) for rows in etp_rows]

        x_recv_ND = all_to_all(x_sorted_ND, recv_splits, send_splits, self.ep_group)
        x_grid_MD = all_gather_sum_grad(x_recv_ND, self.etp_group, 0, etp_sizes)
        local_expert_M = torch.arange(L, device=x_TD.device).repeat(Q * P)
        local_expert_M = local_expert_M.repeat_interleave(counts_QPL.reshape(-1), output_size=sum(etp_sizes))
        expert_order_M = stable_expert_order(local_expert_M, L)
        expert_inverse_M = inverse_permutation(expert_order_M)
        handle = AllToAllHandle(sorted_order_N, send_splits, recv_splits, etp_sizes, expert_order_M, expert_inverse_M)
        x_local_MD = permute_rows(x_grid_MD, expert_order_M, expert_inverse_M)
        return x_local_MD, counts_QPL.sum(dim=(0, 1)), handle

    @torch.compiler.disable
    def combine(self, y_local_MD, gates_TK, handle: AllToAllHandle):
        y_grid_MD = permute_rows(y_local_MD, handle.expert_inverse_M, handle.expert_order_M)
        y_recv_ND = reduce_scatter_to_group(y_grid_MD, self.etp_group, 0, handle.etp_sizes)
        y_sorted_ND = all_to_all(y_recv_ND, handle.send_splits, handle.recv_splits, self.ep_group)
        return unpermute(y_sorted_ND, handle.sorted_order_N, gates_TK)


@dataclass
class AllGatherHandle:
    local_order_M: torch.Tensor  # flat assignment t*K + k of the gathered tokens, local-expert-major
    num_tokens: int  # gathered tokens
    etp_sizes: list[int]  # tokens of each etp rank
    ep_sizes: list[int]  # tokens of each ep rank's etp group


class AllGatherDispatcher(_ExpertParallelDispatcher):
    """All-gather tokens and routing over etp, then over ep (so every rank of one expert-parallel
    replica holds the same tokens), keep the rows of local experts; combine weights them by the
    gathered gates and reduce-scatters the partial outputs over ep, then over etp."""

    def _gather(self, t_TX: torch.Tensor, etp_sizes: list[int], ep_sizes: list[int]) -> torch.Tensor:
        by_etp_TX = all_gather_sum_grad(t_TX, self.etp_group, 0, etp_sizes)
        return all_gather_sum_grad(by_etp_TX, self.ep_group, 0, ep_sizes)

    @torch.compiler.disable
    def dispatch(self, x_TD, expert_idx_TK):
        T, K = expert_idx_TK.shape
        L, me = self.num_local, group_rank(self.ep_group)
        first = me * L
        counts_E = expert_counts(expert_idx_TK.reshape(-1), self.num_experts)
        meta_X = torch.cat([counts_E.new_tensor([T]), counts_E])  # X = 1 + E
        meta_PQX = _gather_counts(_gather_counts(meta_X, self.etp_group), self.ep_group)
        host_PQX = meta_PQX.tolist()  # the one device-to-host sync
        tokens_PQ = [[meta[0] for meta in metas_Q] for metas_Q in host_PQX]
        etp_sizes, ep_sizes = tokens_PQ[me], [sum(tokens_Q) for tokens_Q in tokens_PQ]
        local_rows = sum(sum(meta[1 + first : 1 + first + L]) for metas_Q in host_PQX for meta in metas_Q)

        x_all_TD = self._gather(x_TD, etp_sizes, ep_sizes)
        expert_N = self._gather(expert_idx_TK, etp_sizes, ep_sizes).reshape(-1) - first
        is_local_N = (expert_N >= 0) & (expert_N < L)
        local_order_M = stable_expert_order(torch.where(is_local_N, expert_N, L), L + 1)[:local_rows]
        counts_L = meta_PQX[..., 1 + first : 1 + first + L].sum(dim=(0, 1))
        handle = AllGatherHandle(local_order_M, sum(ep_sizes), etp_sizes, ep_sizes)
        return x_all_TD.index_select(0, local_order_M // K), counts_L, handle

    @torch.compiler.disable
    def combine(self, y_local_MD, gates_TK, handle: AllGatherHandle):
        K, D = gates_TK.shape[1], y_local_MD.shape[1]
        gates_all_TK = self._gather(gates_TK, handle.etp_sizes, handle.ep_sizes)
        gates_M = gates_all_TK.reshape(-1).index_select(0, handle.local_order_M)
        weighted_MD = y_local_MD.float() * gates_M.float().unsqueeze(-1)
        y_all_TD = weighted_MD.new_zeros(handle.num_tokens, D).index_add(0, handle.local_order_M // K, weighted_MD)
        y_TD = reduce_scatter_to_group(y_all_TD, self.ep_group, 0, handle.ep_sizes)
        y_TD = reduce_scatter_to_group(y_TD, self.etp_group, 0, handle.etp_sizes)
        return y_TD.to(y_local_MD.dtype)
