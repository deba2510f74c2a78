"""The parallel counterparts of a single-device `MoELayer`'s parts, applied from outside.

`parallelize_moe` keeps this rank's experts (ep) and its slice of their ffn dim (etp) and replaces
the layer's `dispatcher` (`LocalDispatcher`) with `ExpertParallel`, which sends every token-expert
assignment to the rank holding its expert and the outputs back, around the layer's local experts.
Routing, the aux loss and the shared expert stay the layer's own, replicated. Parameter names do
not change, so a parallelized model's expert parameters are found by name (`expert_param_names`);
their gradients are reduced over edp, every other parameter's over dp x cp.

`SplitTokens` replaces the layer's `AllTokens` where the ranks of a tensor- and context-parallel
group share one microbatch (dyad/llm_service/parallelize.py applies both).

Legend: T tokens, K experts per token, D model dim, E experts, L = E/ep local experts,
F expert ffn dim (Fl = F/etp on this rank), M rows for this rank's experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dyad.llm_service.moe import MoELayer
from dyad.llm_service.moe_dispatch import AllGatherDispatcher, AllToAllDispatcher
from dyad.parallel.collectives import (
    all_gather_cat,
    gather_from_group,
    group_rank,
    group_size,
    own_chunk,
    split_to_group,
)
from dyad.parallel.sharded import ShardedParameters

# The dim each expert weight is sliced on over etp: w13 column-wise, w2 row-wise. w13's columns come
# in (gate, up) pairs, so a column slice of F/etp pairs keeps them together.
EXPERT_TP_DIM = {"w13_ED2F": 2, "w2_EFD": 1}
DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


class ExpertParallel(nn.Module, ShardedParameters):
    """The expert-parallel counterpart of a MoE layer's `LocalDispatcher`: `dispatch` sends the
    rows to the experts' ranks and `combine` brings their outputs back (all-to-all or all-gather,
    dyad/llm_service/moe_dispatch.py), so the layer's experts see only their own rows. It also cut
    the layer's expert weights, and says how: experts over ep (dim 0), ffn dim over etp."""

    def __init__(self, dispatcher: str, num_experts: int, ep_group, etp_group=None):
        super().__init__()
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher {dispatcher!r} is not one of {', '.join(DISPATCHERS)}")
        self.exchange = DISPATCHERS[dispatcher](ep_group, num_experts, etp_group)
        self.ep_group, self.etp_group = ep_group, etp_group

    def dispatch(self, x_TD: torch.Tensor, expert_idx_TK: torch.Tensor):
        return self.exchange.dispatch(x_TD, expert_idx_TK)

    def combine(self, y_local_MD: torch.Tensor, gates_TK: torch.Tensor, handle) -> torch.Tensor:
        return self.exchange.combine(y_local_MD, gates_TK, handle)

    def cuts(self, owner: nn.Module, name: str) -> bool:
        return name in EXPERT_TP_DIM

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts (dim 0 over ep) and their slice over etp of a full expert tensor."""
        experts = full.chunk(group_size(self.ep_group), dim=0)[group_rank(self.ep_group)]
        return experts.chunk(group_size(self.etp_group), dim=EXPERT_TP_DIM[name])[group_rank(self.etp_group)]

    def gather_full(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return _gather_dim(_gather_dim(value, EXPERT_TP_DIM[name], self.etp_group), 0, self.ep_group)


def _gather_dim(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    return t if group_size(group) == 1 else all_gather_cat(t, group, dim)


def parallelize_moe(
    layer: MoELayer,
    *,
    ep_group: dist.ProcessGroup,
    etp_group: dist.ProcessGroup | None = None,
    dispatcher: str = "alltoall",
) -> None:
    """In place: the layer keeps its local experts and dispatches through `ExpertParallel`. The
    degrees must fit the layer (`dyad.layout.validate_llm_layout`: ep divides num_experts, etp
    divides expert_dim)."""
    expert_parallel = ExpertParallel(dispatcher, layer.cfg.num_experts, ep_group, etp_group)
    for name in layer.expert_weight_names():
        full = getattr(layer, name)
        local = expert_parallel.local_part(name, full.detach())
        setattr(layer, name, nn.Parameter(local.clone(), requires_grad=full.requires_grad))
    layer.dispatcher = expert_parallel


class SplitTokens(nn.Module):
    """The counterpart of a MoE layer's `AllTokens` where the ranks of its `stats_group` (tp x cp)
    share one microbatch. Each rank of `split_group` (tp, whose ranks hold the same tokens unless
    sequence parallelism split them already: then None) routes its own contiguous 1/tp of them, so
    no token is routed twice, and the outputs are gathered back. Every rank computes the same aux
    loss from the reduced statistics and contributes 1/`ranks` of it, so the gradient through the
    statistics' all-reduce is counted once."""

    def __init__(self, split_group, ranks: int):
        super().__init__()
        self.split_group, self.ranks = split_group, ranks

    def split(self, x_TD, valid_T, seq_ids_T):
        return split_to_group(x_TD, self.split_group, 0), self._own(valid_T), self._own(seq_ids_T)

    def gather(self, y_TD, aux):
        return gather_from_group(y_TD, self.split_group, 0), aux / self.ranks

    def _own(self, t_T: torch.Tensor | None) -> torch.Tensor | None:
        if t_T is None or group_size(self.split_group) == 1:
            return t_T
        return own_chunk(t_T, self.split_group, 0)


def expert_param_names(model: nn.Module) -> set[str]:
    """Names (as in `model.named_parameters()`) of every MoE layer's expert weights."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, MoELayer)
        for name in module.expert_weight_names()
    }
