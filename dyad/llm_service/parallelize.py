"""Parallelize a single-device `MoELM` in place for one rank of an LLM layout, and say how its
gradients are reduced and counted.

Every step replaces modules of the single-device model with their parallel counterparts (classes
that say what they do), never a method. Order (fixed):
0. pipeline parallelism (dyad/llm_service/pipeline.py): what this rank's stages do not hold
   becomes `OnAnotherStage`, which holds no weights; the steps below parallelize what is held;
1. tensor parallelism (dyad/parallel/tensor.py, dyad/llm_service/tensor_parallel.py): attention's,
   the dense FFNs' and the output's linears become `ColumnParallelLinear` / `RowParallelLinear`,
   the embedding `VocabParallelEmbedding`, the caption loss `VocabParallelCrossEntropy`, the
   argmax `VocabParallelPredictedTargets`, a query/key norm over the whole projection
   `ProjectionParallelRMSNorm`; multi-head latent attention's up-projections and output
   split by heads, its latents whole, its shared rotary key `EnterHeadParallel`; with sequence
   parallelism the residual stream
   (`MoELM.sequence`) becomes `SequenceParallel`, split along the sequence over tp;
2. context parallelism (dyad/llm_service/context_parallel.py): each attention's `core` becomes
   `ContextParallelAttention`;
3. expert parallelism (dyad/llm_service/expert_parallel.py): each MoE layer keeps its local
   experts and its `dispatcher` becomes `ExpertParallel`; where tp x cp ranks share a
   microbatch, its `tokens` become `SplitTokens`, splitting the tokens over tp first (unless
   sequence parallelism already did) so no token is routed twice.
Float8 (dyad/llm_service/fp8.py) is applied before, to the single-device model; the pool then
wraps blocks for recomputation (dyad/recompute.py) and compiles them (dyad/compile.py), in that
order.

Gradient groups:
- expert weights: summed over edp (every token reaches its expert exactly once in the world);
- MoE router and shared expert, and with sequence parallelism the norms and MLA's
  down-projections: summed over the stage (each of its ranks sees distinct tokens);
- everything else: summed over dp×cp (tp ranks hold shards, or identical replicas).
Every group lies inside one pipeline stage, which alone holds the parameters.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch import nn

from dyad.llm_service.context_parallel import ContextParallelAttention
from dyad.llm_service.expert_parallel import SplitTokens, expert_param_names, parallelize_moe
from dyad.llm_service.model import Attention, LatentAttention, ProjectionNorm
from dyad.llm_service.pipeline import cut_stages, held
from dyad.llm_service.tensor_parallel import (
    EnterHeadParallel,
    ProjectionParallelRMSNorm,
    SequenceParallel,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelPredictedTargets,
)
from dyad.parallel.gradients import GradientPlan, is_sharded
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def parallelize_llm(model: nn.Module, groups: ProcessGroups, *, sequence_parallel: bool = False) -> GradientPlan:
    layout = groups.layout
    sequence_parallel = sequence_parallel and layout.tp > 1
    if layout.pp > 1:
        cut_stages(model, layout, groups.index("pp"))
    tp_sharded: set[int] = set()
    if layout.tp > 1:
        tp_sharded = _apply_tensor_parallel(model, groups.group("tp"), sequence_parallel)
    if layout.cp > 1:
        for block in _blocks(model):
            block.attention.core = ContextParallelAttention(groups.group("cp"))
    # Parameters each rank trains on its own tokens (or, the per-head query/key norms under tp,
    # on its own heads): their gradients are summed over every rank.
    token_distinct: set[int] = set()
    if layout.tp > 1:
        token_distinct |= {
            id(p) for block in _blocks(model) if isinstance(block.attention, Attention)
            for norm in (block.attention.q_norm, block.attention.k_norm)
            if isinstance(norm, nn.RMSNorm) for p in norm.parameters()
        }
    for block in _blocks(model):
        if block.is_moe:
            token_distinct |= _apply_expert_parallel(block.feed_forward, groups, sequence_parallel)
    if sequence_parallel:
        token_distinct |= {id(p) for m in model.modules() if isinstance(m, nn.RMSNorm) for p in m.parameters()}
        # MLA's down-projections, like the norms, see this rank's part of the sequence.
        token_distinct |= {id(p) for linear in _latent_down_projections(model) for p in linear.parameters()}
    experts = {id(p) for n, p in model.named_parameters() if n in expert_param_names(model)}
    return _gradient_plan(model, groups, tp_sharded, token_distinct, experts)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers this rank holds."""
    return [block for block in model.layers if held(block)]


def _apply_tensor_parallel(model: nn.Module, tp_group, sequence_parallel: bool) -> set[int]:
    if held(model.tok_embeddings):
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, tp_group)
    if held(model.output):
        model.output = ColumnParallelLinear(model.output, tp_group)
        model.caption_loss = VocabParallelCrossEntropy(model.output, model.cfg.vocab_size)
        model.predicted_targets = VocabParallelPredictedTargets(model.output, model.cfg.vocab_size)
    tp = dist.get_world_size(tp_group)
    column = functools.partial(ColumnParallelLinear, group=tp_group, sequence_parallel=sequence_parallel)
    row = functools.partial(RowParallelLinear, group=tp_group, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        model.sequence = SequenceParallel(tp_group)
    for block in _blocks(model):
        attention = block.attention
        if isinstance(attention, LatentAttention):
            _latent_attention_tensor_parallel(attention, tp_group, sequence_parallel)
        else:
            attention.wq, attention.wk, attention.wv = column(attention.wq), column(attention.wk), column(attention.wv)
            attention.wo = row(attention.wo)
            if isinstance(attention.q_norm, ProjectionNorm):  # over the heads, which tp splits
                attention.q_norm = ProjectionParallelRMSNorm(attention.q_norm, tp_group)
                attention.k_norm = ProjectionParallelRMSNorm(attention.k_norm, tp_group)
            attention.n_heads //= tp
            attention.n_kv_heads //= tp
        if not block.is_moe:
            ffn = block.feed_forward
            ffn.w1, ffn.w3, ffn.w2 = column(ffn.w1), column(ffn.w3), row(ffn.w2)
    return {
        id(p)
        for module in model.modules()
        for name, p in module.named_parameters()
        if is_sharded(module, name)
    }


def _latent_attention_tensor_parallel(attention: LatentAttention, tp_group, sequence_parallel: bool) -> None:
    """MLA's heads split over tp: the up-projections from the latents (and a query projection
    without one) column-parallel, the output row-parallel. The down-projections and the latents'
    norms stay whole on every rank (under sequence parallelism, over its part of the sequence):
    entering the head-parallel region through the column-parallel layers and `rope_key`, their
    outputs get every rank's heads' gradients."""
    column = functools.partial(ColumnParallelLinear, group=tp_group, sequence_parallel=sequence_parallel)
    if attention.wq is not None:
        attention.wq = column(attention.wq)
    else:
        attention.wq_b = column(attention.wq_b)
    attention.wkv_b = column(attention.wkv_b)
    attention.wo = RowParallelLinear(attention.wo, tp_group, sequence_parallel=sequence_parallel)
    attention.rope_key = EnterHeadParallel(tp_group, sequence_parallel)
    attention.n_heads //= dist.get_world_size(tp_group)


def _latent_down_projections(model: nn.Module) -> list[nn.Linear]:
    """MLA's projections into its latents, whole on every tensor-parallel rank."""
    attentions = [block.attention for block in _blocks(model) if isinstance(block.attention, LatentAttention)]
    return [a.wkv_a for a in attentions] + [a.wq_a for a in attentions if a.wq is None]


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
        split_over_tp = layout.tp > 1 and not sequence_parallel
        layer.tokens = SplitTokens(groups.group("tp") if split_over_tp else None, shared)
    experts = layer.expert_weight_names()
    return {id(p) for name, p in layer.named_parameters() if name not in experts}


def _gradient_plan(model, groups, tp_sharded, token_distinct, experts) -> GradientPlan:
    plan = GradientPlan()
    for param in model.parameters():
        if id(param) in experts:
            group, counted = "edp", True
        elif id(param) in token_distinct:
            group, counted = "stage", True
        elif id(param) in tp_sharded:
            group, counted = "dp_cp", True
        else:  # the same on every tp rank
            group, counted = "dp_cp", groups.index("tp") == 0
        plan.reduce_over.setdefault(group, []).append(param)
        if counted:
            plan.counted.append(param)
    return plan
