"""Expert parallelism applied from outside to a single-device `MoELayer`.

`parallelize_moe` keeps this rank's experts (ep) and its slice of their ffn dim (etp) and replaces
the layer's `routed_experts` with one that dispatches tokens over the groups. Routing, the aux loss
and the shared expert stay the layer's own, replicated. Parameter names do not change, so a
parallelized model's expert parameters are found by name (`expert_param_names`); their gradients
are reduced over edp, every other parameter's over dp x cp.

Legend: T tokens, K experts per token, D model dim, E experts, L = E/ep local experts,
F expert ffn dim (Fl = F/etp on this rank), M rows for this rank's experts.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from dyad.kernels.moe_dispatch import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    gather_replicated,
    group_rank,
    group_size,
    split_replicated,
)
from dyad.llm_service.moe import MoELayer
from dyad.parallel.collectives import all_gather_cat

# The dim each expert weight is sliced on over etp: w1/w3 column-wise, w2 row-wise. Interleaved,
# w13's columns come in (gate, up) pairs, so a column slice of F/etp pairs keeps them together.
EXPERT_TP_DIM = {"w1_EDF": 2, "w3_EDF": 2, "w13_ED2F": 2, "w2_EFD": 1}
DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def parallelize_moe(
    layer: MoELayer,
    *,
    ep_group: dist.ProcessGroup,
    etp_group: dist.ProcessGroup | None = None,
    dispatcher: str = "alltoall",
    token_split_group: dist.ProcessGroup | None = None,
) -> None:
    """In place. `token_split_group`: a group over which the tokens entering the layer are identical
    (tp without sequence parallelism); each rank dispatches only its contiguous 1/n of them."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher {dispatcher!r} is not one of {', '.join(DISPATCHERS)}")
    token_dispatcher = DISPATCHERS[dispatcher](ep_group, layer.cfg.num_experts, etp_group)  # checks E % ep
    ffn_dim, etp = layer.cfg.expert_dim, group_size(etp_group)
    if ffn_dim % etp:
        raise ValueError(f"expert_dim ({ffn_dim}) must be divisible by etp ({etp})")
    ep_rank, etp_rank = group_rank(ep_group), group_rank(etp_group)
    for name in layer.expert_weight_names():
        full = getattr(layer, name)
        local = local_expert_shard(full.detach(), name, ep_rank, group_size(ep_group), etp_rank, etp)
        setattr(layer, name, nn.Parameter(local.clone(), requires_grad=full.requires_grad))
    layer.routed_experts = partial(_routed_experts, layer, token_dispatcher, token_split_group)


def local_expert_shard(full: torch.Tensor, name: str, ep_rank: int, ep: int, etp_rank: int, etp: int) -> torch.Tensor:
    """This rank's experts (dim 0 over ep) and their slice over etp of a full expert tensor."""
    experts = full.chunk(ep, dim=0)[ep_rank]
    return experts.chunk(etp, dim=EXPERT_TP_DIM[name])[etp_rank]


def _routed_experts(layer: MoELayer, dispatcher, token_split_group, x_TD, gates_TK, expert_idx_TK):
    num_tokens = x_TD.shape[0]
    if token_split_group is not None:
        x_TD, gates_TK = split_replicated(x_TD, token_split_group), split_replicated(gates_TK, token_split_group)
        expert_idx_TK = split_replicated(expert_idx_TK, token_split_group)
    x_local_MD, counts_L, handle = dispatcher.dispatch(x_TD, expert_idx_TK)
    y_local_MD = layer.experts(x_local_MD, counts_L)  # partial sums over etp
    y_TD = dispatcher.combine(y_local_MD, gates_TK, handle)
    if token_split_group is not None:
        y_TD = gather_replicated(y_TD, num_tokens, token_split_group)
    return y_TD


def expert_param_names(model: nn.Module) -> set[str]:
    """Names (as in `model.named_parameters()`) of every MoE layer's expert weights."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, MoELayer)
        for name in module.expert_weight_names()
    }


def gather_expert_tensor(local: torch.Tensor, ep_group, etp_group, name: str) -> torch.Tensor:
    """A sharded expert weight (or its gradient) back at full shape on every rank of the groups.
    `name` is the parameter's name in the layer (a key of EXPERT_TP_DIM). Not differentiable."""
    return _gather_dim(_gather_dim(local, EXPERT_TP_DIM[name], etp_group), 0, ep_group)


def _gather_dim(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    if group_size(group) == 1:
        return t
    return all_gather_cat(t, group, dim)
