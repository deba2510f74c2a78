"""Dropless token-choice Mixture-of-Experts layer with SwiGLU experts.

Legend: T tokens, D model dim, E experts, K experts per token (top_k), N = T*K assignments,
F expert ffn dim, H shared-expert ffn dim.

Routing runs in float32 (autocast off): scores = softmax(x @ router), the top-k scores are the gates
(renormalised to sum to 1 when norm_topk_prob). Every assignment is computed (no capacity, no
dropping): copies of the tokens are permuted to expert-major order, run through the stacked
expert weights with one grouped matmul per projection, and summed back weighted by the gates.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dyad.kernels.grouped_mm import grouped_mm
from dyad.kernels.moe_permute import permute, unpermute


@dataclass(kw_only=True)
class MoEConfig:
    num_experts: int = 4
    top_k: int = 2
    expert_dim: int = 128
    shared_expert_dim: int = 0  # 0: no shared expert
    aux_loss_coef: float = 0.01
    norm_topk_prob: bool = True

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"llm.moe.num_experts ({self.num_experts}) must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"llm.moe.top_k ({self.top_k}) must be in [1, llm.moe.num_experts ({self.num_experts})]")
        if self.expert_dim < 1:
            raise ValueError(f"llm.moe.expert_dim ({self.expert_dim}) must be >= 1")
        if self.shared_expert_dim < 0:
            raise ValueError(f"llm.moe.shared_expert_dim ({self.shared_expert_dim}) must be >= 0 (0 disables it)")
        if self.aux_loss_coef < 0:
            raise ValueError(f"llm.moe.aux_loss_coef ({self.aux_loss_coef}) must be >= 0")


class SwiGLU(nn.Module):
    """Dense SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_TD)) * self.w3(x_TD))


def load_balancing_loss(scores_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-style E * sum_e f_e * P_e; f_e = share of assignments, P_e = mean router score.

    Only P carries gradient. With T == 0 the loss is 0 (and still part of the graph).
    """
    T, E = scores_TE.shape
    f_E = counts_E.float() / max(T * top_k, 1)
    P_E = scores_TE.sum(dim=0) / max(T, 1)
    return E * (f_E * P_E).sum()


class MoELayer(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        E, ffn_dim = cfg.num_experts, cfg.expert_dim
        self.router = nn.Linear(dim, E, bias=False)
        self.w1_EDF = nn.Parameter(torch.empty(E, dim, ffn_dim))
        self.w3_EDF = nn.Parameter(torch.empty(E, dim, ffn_dim))
        self.w2_EFD = nn.Parameter(torch.empty(E, ffn_dim, dim))
        for w in (self.w1_EDF, self.w3_EDF, self.w2_EFD):
            nn.init.normal_(w, std=0.02)
        self.shared_expert = SwiGLU(dim, cfg.shared_expert_dim) if cfg.shared_expert_dim > 0 else None
        self.last_expert_counts_E: torch.Tensor | None = None

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (scores_TE, gates_TK, expert_idx_TK), all routing math in float32."""
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.router.weight.float())
        scores_TE = torch.softmax(logits_TE, dim=-1)
        gates_TK, expert_idx_TK = torch.topk(scores_TE, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            gates_TK = gates_TK / gates_TK.sum(dim=-1, keepdim=True)
        return scores_TE, gates_TK, expert_idx_TK

    def experts(self, x_sorted_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        offs_E = torch.cumsum(counts_E, dim=0).to(torch.int32)
        h1_NF = grouped_mm(x_sorted_ND, self.w1_EDF, offs_E)
        h3_NF = grouped_mm(x_sorted_ND, self.w3_EDF, offs_E)
        return grouped_mm(F.silu(h1_NF) * h3_NF, self.w2_EFD, offs_E)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_TD, aux_loss); aux_loss is the unscaled load-balancing loss."""
        scores_TE, gates_TK, expert_idx_TK = self.route(x_TD)
        x_sorted_ND, sorted_order_N, counts_E = permute(x_TD, expert_idx_TK, self.cfg.num_experts)
        y_sorted_ND = self.experts(x_sorted_ND, counts_E)
        y_TD = unpermute(y_sorted_ND, sorted_order_N, gates_TK)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        self.last_expert_counts_E = counts_E.detach()
        return y_TD, load_balancing_loss(scores_TE, counts_E, self.cfg.top_k)
