"""Parallelize a single-device `MoELM` in place for one rank of an LLM layout, and say how its
gradients are reduced and counted.

Order (fixed): tensor parallelism of attention, dense FFN, embedding and output (optionally with
sequence parallelism: the residual stream split along the sequence over tp); context parallelism
of the attention core; expert parallelism of the MoE layers, whose tokens are split over tp
first (unless sequence parallelism already did) so no token is routed twice.

Gradient groups:
- expert weights: summed over edp (every token reaches its expert exactly once in the world);
- MoE router and shared expert, and with sequence parallelism the norms: summed over the whole
  pool (each rank sees distinct tokens);
- everything else: summed over dp×cp (tp ranks hold shards, or identical replicas).
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch import nn

from dyad.parallel.context import ContextParallelAttention
from dyad.parallel.expert import expert_param_names, parallelize_moe
from dyad.parallel.gradients import GradientPlan, is_tp_sharded
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallel,
    VocabParallelEmbedding,
    gather_from_group,
    split_to_group,
    vocab_parallel_cross_entropy_sum,
)


def parallelize_llm(model: nn.Module, groups: ProcessGroups, *, sequence_parallel: bool = False) -> GradientPlan:
    layout = groups.layout
    sequence_parallel = sequence_parallel and layout.tp > 1
    tp_sharded: set[int] = set()
    if layout.tp > 1:
        tp_sharded = _apply_tensor_parallel(model, groups.group("tp"), sequence_parallel)
    if layout.cp > 1:
        core = ContextParallelAttention(groups.group("cp"))
        for block in model.layers:
            block.attention.core = core
    token_distinct: set[int] = set()  # parameters each rank trains on its own tokens
    for block in model.layers:
        if block.is_moe:
            token_distinct |= _apply_expert_parallel(block.feed_forward, groups, sequence_parallel)
    if sequence_parallel:
        token_distinct |= {id(p) for m in model.modules() if isinstance(m, nn.RMSNorm) for p in m.parameters()}
    experts = {id(p) for n, p in model.named_parameters() if n in expert_param_names(model)}
    return _gradient_plan(model, groups, tp_sharded, token_distinct, experts)


def _apply_tensor_parallel(model: nn.Module, tp_group, sequence_parallel: bool) -> set[int]:
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, tp_group)
    model.output = ColumnParallelLinear(model.output, tp_group)
    vocab_start = dist.get_rank(tp_group) * model.output.weight.shape[0]
    model.loss_sum = functools.partial(
        vocab_parallel_cross_entropy_sum,
        group=tp_group,
        vocab_start=vocab_start,
        vocab_size=model.cfg.vocab_size,
    )
    tp = dist.get_world_size(tp_group)
    column = functools.partial(ColumnParallelLinear, group=tp_group, sequence_parallel=sequence_parallel)
    row = functools.partial(RowParallelLinear, group=tp_group, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        model.sequence = SequenceParallel(tp_group)
    for block in model.layers:
        attention = block.attention
        attention.wq, attention.wk, attention.wv = column(attention.wq), column(attention.wk), column(attention.wv)
        attention.wo = row(attention.wo)
        attention.n_heads //= tp
        attention.n_kv_heads //= tp
        if not block.is_moe:
            ffn = block.feed_forward
            ffn.w1, ffn.w3, ffn.w2 = column(ffn.w1), column(ffn.w3), row(ffn.w2)
    return {
        id(p)
        for module in model.modules()
        for name, p in module.named_parameters()
        if is_tp_sharded(module, name)
    }


def _apply_expert_parallel(layer: nn.Module, groups: ProcessGroups, sequence_parallel: bool) -> set[int]:
    """Shard the experts over ep×etp; split tokens over tp (unless sequence parallelism already
    did); reduce router statistics over the ranks that share a microbatch. Returns the
    router/shared-expert parameters."""
    layout = groups.layout
    if layout.ep * layout.etp > 1:
        parallelize_moe(
            layer,
            ep_group=groups.group("ep"),
            etp_group=groups.group("etp"),
            dispatcher=layer.cfg.dispatcher,
        )
    shared = layout.tp * layout.cp
    if shared > 1:
        layer.stats_group = groups.group("tp_cp")
    if shared > 1:
        _split_tokens(layer, groups.group("tp"), 1 if sequence_parallel else layout.tp, shared)
    routed = {id(p) for name, p in layer.named_parameters() if not name.startswith(("w1_", "w2_", "w3_"))}
    return routed


def _split_tokens(layer: nn.Module, tp_group, tp: int, shared: int) -> None:
    """Each tp rank routes its own 1/tp of the (tp-replicated) tokens. Every rank of a microbatch
    computes the same aux loss from reduced statistics and contributes 1/shared of it, so the
    gradient through the statistics' all-reduce is counted once."""
    forward = layer.forward

    @functools.wraps(forward)
    def split_forward(x_TD, valid_T=None, seq_ids_T=None):
        if tp > 1:
            rank = dist.get_rank(tp_group)
            x_TD = split_to_group(x_TD, tp_group, 0)
            valid_T = None if valid_T is None else valid_T.chunk(tp)[rank]
            seq_ids_T = None if seq_ids_T is None else seq_ids_T.chunk(tp)[rank]
        y_TD, aux = forward(x_TD, valid_T, seq_ids_T)
        if tp > 1:
            y_TD = gather_from_group(y_TD, tp_group, 0)
        return y_TD, aux / shared

    layer.forward = split_forward


def _gradient_plan(model, groups, tp_sharded, token_distinct, experts) -> GradientPlan:
    plan = GradientPlan()
    first_in_dp_cp = groups.index("dp_cp") == 0
    for param in model.parameters():
        if id(param) in experts:
            group, counted = "edp", groups.index("edp") == 0
        elif id(param) in token_distinct:
            group, counted = "world", groups.index("world") == 0
        elif id(param) in tp_sharded:
            group, counted = "dp_cp", first_in_dp_cp
        else:
            group, counted = "dp_cp", first_in_dp_cp and groups.index("tp") == 0
        plan.reduce_over.setdefault(group, []).append(param)
        if counted:
            plan.counted.append(param)
    return plan
