"""Token-choice Mixture-of-Experts layer with SwiGLU experts and a configurable router.

Legend: T tokens, D model dim, E experts, K experts per token (top_k), N = T*K assignments,
F expert ffn dim, H shared-expert ffn dim, G expert groups, S sequences.

Router (all in float32, autocast off; `dyad/kernels/moe_router.py` runs the logits and the default
softmax top-k on CUDA in one launch forward), with the defaults first:
- scores = softmax(x @ router) or sigmoid(x @ router).
- Selection is the top k of a key: the scores, or the logits when topk_before_softmax; plus the
  aux-loss-free expert bias when enabled (the bias changes which experts are chosen, never a gate
  value). With n_groups > 1 the key first keeps only the topk_groups best groups, a group's
  strength being the sum of its top group_score_experts keys (default top_k / topk_groups;
  DeepSeek-V3's checkpoints: 2). Ties go to the lower expert index (and the lower group index),
  so routing is deterministic.
- gates = the chosen scores, renormalised over the k when norm_topk_prob; with
  topk_before_softmax, the softmax over the k chosen logits (already summing to 1). The routed
  experts' summed output is then multiplied by routed_scaling_factor (DeepSeek-V3), the shared
  expert's not.
- Capacity (optional): each expert takes at most ceil(capacity_factor * T * K / E) assignments of
  this call (T counts padding), preferring the highest scores ("probs": the router score of that
  expert for that token, not the renormalised gate, which is 1 for every token when K = 1) or the
  earliest tokens ("position"); padding competes last. A dropped assignment stays in expert_idx
  with gate 0: its expert output contributes nothing and it receives no gradient, and every
  dispatcher works unchanged. Gates are not renormalised after dropping.

Padding (valid_T False) is still routed, but is left out of the load-balancing statistics, the
z-loss and the expert counts. Each assignment is computed: the layer's `dispatcher` permutes
copies of the tokens to expert-major order, the experts run them through their stacked weights
(`grouped_swiglu`), and the dispatcher sums them back weighted by the gates. w1 and w3 are one
weight of (gate, up) column pairs, w13_ED2F, so one grouped matmul computes both up-projections;
on Hopper GPUs with QuACK installed, SwiGLU then runs in the expert GEMMs' epilogues
(dyad/kernels/gated_experts.py).

Parts that parallelism replaces from outside (single-device defaults here): `dispatcher`
(`LocalDispatcher`; expert parallelism's `ExpertParallel` sends rows to other ranks' experts),
`grouped_swiglu` (`GroupedSwiGLU`; float8's `Float8GroupedSwiGLU`) and `tokens` (`AllTokens`;
`SplitTokens` where ranks share a microbatch's tokens).

Expert bias: training forwards (grad enabled) add their real tokens' assignments to
`expert_counts_E`; `update_expert_biases(model, group)`, once per global batch before the
optimizer step, sums them over `group`, moves each bias by +-rate towards balance and restarts the
counts.

Aux: forward returns its aux term already scaled by its own coefficients,
aux_loss_coef * balance loss + z_loss_coef * z-loss, so the model just sums layers. The balance
loss is Switch's E * sum_e f_e * P_e (f: share of the router's assignments, P: mean score,
normalised to sum 1 per token for sigmoid) over the microbatch, or averaged over the sequences
of the microbatch ("seq"). f counts assignments as chosen, before capacity dropping.

Distributed statistics: when `stats_group` is set (ranks holding different tokens of one
microbatch, e.g. context-parallel shards), per-expert counts, score sums and token counts are
all-reduced over it (score sums differentiably, `all_reduce_sum_grad`) so every rank computes and
returns the same microbatch loss L. The all-reduce's backward sums the ranks' upstream gradients,
so the rank-summed gradient is that of group size * L: whoever sets `stats_group` scales each
rank's aux by 1 / group size (`SplitTokens` in dyad/llm_service/expert_parallel.py does), after
which the ranks' parts sum to L and their summed gradients to L's gradient, like the caption
loss's per-rank parts.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

from dyad.kernels.expert_weight_grads import expert_grouped_mm
from dyad.kernels.gated_experts import gated_experts
from dyad.kernels.moe_permute import expert_counts
from dyad.kernels.moe_router import route_softmax_topk, router_logits
from dyad.kernels.swiglu import swiglu
from dyad.llm_service.config import MoEConfig
from dyad.llm_service.moe_dispatch import LocalDispatcher
from dyad.parallel.collectives import all_reduce_sum_grad
from dyad.recompute import recomputing


class SwiGLU(nn.Module):
    """Dense SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x_TD), self.w3(x_TD)))


# ---- selection -----------------------------------------------------------------------------------


def top_k_indices(key_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest keys per row, largest first; ties go to the lower index."""
    return torch.sort(key_TE, dim=-1, descending=True, stable=True).indices[:, :k]


def group_limited_mask(key_TE: torch.Tensor, n_groups: int, topk_groups: int, score_experts: int) -> torch.Tensor:
    """[T, E] bool: experts of each token's topk_groups strongest groups (strength: sum of the
    group's top `score_experts` keys)."""
    T, E = key_TE.shape
    strength_TG = key_TE.view(T, n_groups, E // n_groups).topk(score_experts, dim=-1).values.sum(dim=-1)
    chosen_TG = torch.zeros(T, n_groups, dtype=torch.bool, device=key_TE.device)
    chosen_TG.scatter_(1, top_k_indices(strength_TG, topk_groups), True)
    return chosen_TG.repeat_interleave(E // n_groups, dim=1)


def capacity_keep(
    chosen_scores_TK: torch.Tensor,
    expert_idx_TK: torch.Tensor,
    valid_T: torch.Tensor | None,
    capacity: int,
    num_experts: int,
    drop_policy: str,
) -> torch.Tensor:
    """[T, K] bool: the assignments each expert keeps, at most `capacity` per expert, preferring
    higher scores ("probs") or earlier tokens ("position"); padding after every real token; ties
    to the earlier assignment."""
    T, K = expert_idx_TK.shape
    N = T * K
    flat_expert_N = expert_idx_TK.reshape(-1)
    if drop_policy == "probs":
        order_N = torch.argsort(-chosen_scores_TK.detach().reshape(-1), stable=True)
    else:
        order_N = torch.arange(N, device=expert_idx_TK.device)
    if valid_T is not None:
        is_pad_N = (~valid_T).repeat_interleave(K).to(torch.int8)
        order_N = order_N[torch.argsort(is_pad_N[order_N], stable=True)]
    order_N = order_N[torch.argsort(flat_expert_N[order_N], stable=True)]  # expert-major, by preference
    counts_E = expert_counts(flat_expert_N, num_experts)
    starts_E = torch.cumsum(counts_E, dim=0) - counts_E
    slot_N = torch.arange(N, device=order_N.device) - starts_E[flat_expert_N[order_N]]
    keep_N = torch.empty(N, dtype=torch.bool, device=order_N.device).scatter_(0, order_N, slot_N < capacity)
    return keep_N.view(T, K)


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


# ---- statistics and aux losses -------------------------------------------------------------------


def _valid_weights(valid_T: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor:
    """[T] float32: 1 for real tokens, 0 for padding."""
    if valid_T is None:
        return torch.ones(T, device=device)
    return valid_T.to(torch.float32)


def assignment_counts(expert_idx_TK: torch.Tensor, valid_T: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """[E] long: assignments of real tokens to each expert."""
    K = expert_idx_TK.shape[1]
    weights_N = torch.ones_like(expert_idx_TK).reshape(-1)
    if valid_T is not None:
        weights_N = valid_T.long().repeat_interleave(K)
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=expert_idx_TK.device)
    return counts_E.scatter_add_(0, expert_idx_TK.reshape(-1), weights_N)


def _sum_over(group, *stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """All-reduce (sum) float tensors over `group` in one differentiable collective."""
    if group is None:
        return stats
    flat = all_reduce_sum_grad(torch.cat([s.reshape(-1) for s in stats]), group)
    return tuple(part.view(s.shape) for part, s in zip(flat.split([s.numel() for s in stats]), stats))


def switch_balance_loss(
    probs_TE: torch.Tensor,
    expert_idx_TK: torch.Tensor,
    valid_T: torch.Tensor | None = None,
    group=None,
    counts_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """E * sum_e f_e * P_e over the microbatch's real tokens; f_e = share of assignments, P_e = mean
    probability. Only P carries gradient. With no real token the loss is 0 (still in the graph).
    `counts_E`: `assignment_counts` of these arguments when the caller has them already."""
    T, E = probs_TE.shape
    K = expert_idx_TK.shape[1]
    valid_f_T = _valid_weights(valid_T, T, probs_TE.device)
    if counts_E is None:
        counts_E = assignment_counts(expert_idx_TK, valid_T, E)
    counts_E = counts_E.float()
    sums_E = (probs_TE * valid_f_T[:, None]).sum(dim=0)
    sums_E, counts_E, tokens = _sum_over(group, sums_E, counts_E, valid_f_T.sum())
    f_E = counts_E / (tokens * K).clamp_min(1)
    P_E = sums_E / tokens.clamp_min(1)
    return E * (f_E * P_E).sum()


def sequence_balance_loss(
    probs_TE: torch.Tensor,
    expert_idx_TK: torch.Tensor,
    seq_ids_T: torch.Tensor,
    valid_T: torch.Tensor | None = None,
    group=None,
) -> torch.Tensor:
    """The Switch loss of each sequence (seq_ids_T in [0, S)), averaged over the sequences that
    have a real token. S is read from the ids (one host sync; a MAX all-reduce over `group`)."""
    T, E = probs_TE.shape
    K = expert_idx_TK.shape[1]
    num_seqs = int(seq_ids_T.max()) + 1 if T else 0
    if group is not None:
        num_seqs_t = torch.tensor([num_seqs], device=probs_TE.device)
        dist.all_reduce(num_seqs_t, op=dist.ReduceOp.MAX, group=group)
        num_seqs = int(num_seqs_t)
    seqs_S = torch.arange(num_seqs, device=probs_TE.device)
    member_TS = (seq_ids_T[:, None] == seqs_S).float() * _valid_weights(valid_T, T, probs_TE.device)[:, None]
    assigned_TE = torch.zeros(T, E, device=probs_TE.device).scatter_(1, expert_idx_TK, 1.0)
    counts_SE, sums_SE, tokens_S = _sum_over(group, member_TS.T @ assigned_TE, member_TS.T @ probs_TE, member_TS.sum(0))
    f_SE = counts_SE / (tokens_S[:, None] * K).clamp_min(1)
    P_SE = sums_SE / tokens_S[:, None].clamp_min(1)
    loss_S = E * (f_SE * P_SE).sum(dim=-1)
    return loss_S.sum() / (tokens_S > 0).sum().clamp_min(1)


def router_z_loss(logits_TE: torch.Tensor, valid_T: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """Mean over real tokens of logsumexp(logits)^2 (ST-MoE)."""
    valid_f_T = _valid_weights(valid_T, logits_TE.shape[0], logits_TE.device)
    z_T = torch.logsumexp(logits_TE, dim=-1).square()
    total, tokens = _sum_over(group, (z_T * valid_f_T).sum(), valid_f_T.sum())
    return total / tokens.clamp_min(1)


# ---- layer ---------------------------------------------------------------------------------------


class GroupedSwiGLU(nn.Module):
    """The experts' SwiGLU over rows grouped by expert (offs_E: each expert's end row), given
    their weights: SwiGLU(x @ w13) @ w2, in the fused GEMMs of dyad/kernels/gated_experts.py where
    they apply, the plain path elsewhere."""

    def forward(self, x_sorted_ND, w13_ED2F, w2_EFD, offs_E) -> torch.Tensor:
        return gated_experts(x_sorted_ND, w13_ED2F, w2_EFD, offs_E, expert_grouped_mm)


class AllTokens(nn.Module):
    """Which of its input tokens a MoE layer routes, and its share of their aux loss: on one device
    all of them, and all of it."""

    def split(self, x_TD, valid_T, seq_ids_T):
        return x_TD, valid_T, seq_ids_T

    def gather(self, y_TD, aux):
        return y_TD, aux


class MoELayer(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        E, ffn_dim = cfg.num_experts, cfg.expert_dim
        self.router = nn.Linear(dim, E, bias=False)
        self.w13_ED2F = nn.Parameter(torch.empty(E, dim, 2 * ffn_dim))
        self.w2_EFD = nn.Parameter(torch.empty(E, ffn_dim, dim))
        for w in self.expert_weights():
            nn.init.normal_(w, std=0.02)
        self.shared_expert = SwiGLU(dim, cfg.shared_expert_dim) if cfg.shared_expert_dim > 0 else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if cfg.shared_expert_gate else None
        # Aux-loss-free balancing: a selection-only bias (checkpointed) and this global batch's
        # counts of real tokens per expert (not checkpointed: zero after every update).
        self.register_buffer("expert_bias_E", torch.zeros(E) if cfg.expert_bias else None)
        self.register_buffer(
            "expert_counts_E", torch.zeros(E, dtype=torch.long) if cfg.expert_bias else None, persistent=False
        )
        self.stats_group = None  # set from outside: ranks holding different tokens of one microbatch
        self.last_expert_counts_E: torch.Tensor | None = None
        self.tokens = AllTokens()
        self.dispatcher = LocalDispatcher(E)
        self.grouped_swiglu = GroupedSwiGLU()

    def expert_weight_names(self) -> list[str]:
        return ["w13_ED2F", "w2_EFD"]

    def expert_weights(self) -> list[nn.Parameter]:
        return [getattr(self, name) for name in self.expert_weight_names()]

    def router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return router_logits(x_TD, self.router.weight)

    def route(
        self, x_TD: torch.Tensor, valid_T: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (scores_TE, gates_TK, expert_idx_TK), all routing math in float32."""
        cfg = self.cfg
        with torch.autocast(x_TD.device.type, enabled=False):
            if cfg.score_func == "softmax" and not cfg.topk_before_softmax and cfg.n_groups == 1:
                scores_TE, gates_TK, expert_idx_TK = route_softmax_topk(
                    x_TD, self.router.weight, cfg.top_k, self.expert_bias_E, cfg.norm_topk_prob
                )
            else:
                scores_TE, gates_TK, expert_idx_TK = self._select(self.router_logits(x_TD))
            if cfg.capacity_factor is not None:
                capacity = expert_capacity(cfg.capacity_factor, x_TD.shape[0], cfg.top_k, cfg.num_experts)
                chosen_scores_TK = scores_TE.gather(1, expert_idx_TK)
                keep_TK = capacity_keep(
                    chosen_scores_TK, expert_idx_TK, valid_T, capacity, cfg.num_experts, cfg.drop_policy
                )
                gates_TK = gates_TK * keep_TK
        return scores_TE, gates_TK, expert_idx_TK

    def _select(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores_TE, gates_TK, expert_idx_TK) for every router option (`softmax_topk` is the
        default options' fast path)."""
        cfg = self.cfg
        scores_TE = torch.softmax(logits_TE, dim=-1) if cfg.score_func == "softmax" else torch.sigmoid(logits_TE)
        key_TE = logits_TE if cfg.topk_before_softmax else scores_TE
        if self.expert_bias_E is not None:
            key_TE = key_TE + self.expert_bias_E.float()
        if cfg.n_groups > 1:
            score_experts = cfg.group_score_experts or cfg.top_k // cfg.topk_groups
            allowed_TE = group_limited_mask(key_TE, cfg.n_groups, cfg.topk_groups, score_experts)
            key_TE = key_TE.masked_fill(~allowed_TE, -math.inf)
        expert_idx_TK = top_k_indices(key_TE, cfg.top_k)
        if cfg.topk_before_softmax:
            gates_TK = torch.softmax(logits_TE.gather(1, expert_idx_TK), dim=-1)
        else:
            gates_TK = scores_TE.gather(1, expert_idx_TK)
            if cfg.norm_topk_prob:  # the epsilon only matters for underflowed sigmoid scores
                gates_TK = gates_TK / (gates_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return scores_TE, gates_TK, expert_idx_TK

    def experts(self, x_sorted_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The experts held here, over rows grouped by expert (counts_E rows each)."""
        offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        return self.grouped_swiglu(x_sorted_ND, self.w13_ED2F, self.w2_EFD, offs_E)

    def routed_experts(self, x_TD: torch.Tensor, gates_TK: torch.Tensor, expert_idx_TK: torch.Tensor) -> torch.Tensor:
        """sum_k gates[t, k] * expert_{idx[t, k]}(x[t]): the dispatcher brings each copy of a token
        to its expert, the experts run, the dispatcher sums their outputs back by the gates."""
        x_sorted_ND, counts_E, handle = self.dispatcher.dispatch(x_TD, expert_idx_TK)
        return self.dispatcher.combine(self.experts(x_sorted_ND, counts_E), gates_TK, handle)

    def aux_loss(
        self,
        x_TD: torch.Tensor,
        scores_TE: torch.Tensor,
        expert_idx_TK: torch.Tensor,
        valid_T: torch.Tensor | None = None,
        seq_ids_T: torch.Tensor | None = None,
        counts_E: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """aux_loss_coef * balance loss + z_loss_coef * z-loss over the microbatch (see the module
        docstring for `stats_group`); `counts_E` as in `switch_balance_loss`."""
        cfg, group = self.cfg, self.stats_group
        aux = scores_TE.new_zeros(())
        probs_TE = scores_TE
        if cfg.score_func == "sigmoid":
            probs_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.aux_loss == "micro_batch":
            aux = aux + cfg.aux_loss_coef * switch_balance_loss(probs_TE, expert_idx_TK, valid_T, group, counts_E)
        elif cfg.aux_loss == "seq":
            if seq_ids_T is None:
                raise ValueError("llm.moe.aux_loss 'seq' needs seq_ids_T (the sequence of each token)")
            aux = aux + cfg.aux_loss_coef * sequence_balance_loss(probs_TE, expert_idx_TK, seq_ids_T, valid_T, group)
        if cfg.z_loss_coef > 0:  # recomputes the (small) router matmul rather than widening route()
            aux = aux + cfg.z_loss_coef * router_z_loss(self.router_logits(x_TD), valid_T, group)
        return aux

    def forward(
        self, x_TD: torch.Tensor, valid_T: torch.Tensor | None = None, seq_ids_T: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_TD, aux): aux is already scaled by its coefficients (see the module docstring)."""
        x_TD, valid_T, seq_ids_T = self.tokens.split(x_TD, valid_T, seq_ids_T)
        scores_TE, gates_TK, expert_idx_TK = self.route(x_TD, valid_T)
        y_TD = self.routed_experts(x_TD, gates_TK, expert_idx_TK)
        if self.cfg.routed_scaling_factor != 1.0:
            y_TD = y_TD * self.cfg.routed_scaling_factor
        if self.shared_expert is not None:
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        counts_E = assignment_counts(expert_idx_TK, valid_T, self.cfg.num_experts)
        self.last_expert_counts_E = counts_E
        if self.expert_counts_E is not None and self.training and torch.is_grad_enabled() and not recomputing():
            self.expert_counts_E += counts_E  # once per forward pass, not again when recomputed
        return self.tokens.gather(y_TD, self.aux_loss(x_TD, scores_TE, expert_idx_TK, valid_T, seq_ids_T, counts_E))

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """bias += rate * sign(mean(counts) - counts), counts summed over `group` (every rank that
        saw different tokens; None: this process only); then the counts restart. Once per global
        batch, before the optimizer step. A no-op without llm.moe.expert_bias."""
        if self.expert_bias_E is None:
            return
        if group is not None:
            dist.all_reduce(self.expert_counts_E, group=group)
        counts_E = self.expert_counts_E.float()
        self.expert_bias_E += self.cfg.expert_bias_rate * torch.sign(counts_E.mean() - counts_E)
        self.expert_counts_E.zero_()


def update_expert_biases(model: nn.Module, group=None) -> None:
    """`update_expert_bias(group)` on every MoE layer of `model` (a collective when group is set)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.update_expert_bias(group)


def zero_expert_counts(model: nn.Module) -> None:
    """Fresh zero expert counts beside each MoE layer's expert bias, on the bias's device: for a
    model built on the meta device and loaded from a state dict, which does not hold the counts."""
    for module in model.modules():
        if isinstance(module, MoELayer) and module.expert_bias_E is not None:
            module.expert_counts_E = torch.zeros(module.cfg.num_experts, dtype=torch.long, device=module.expert_bias_E.device)
