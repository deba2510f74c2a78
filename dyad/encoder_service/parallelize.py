"""Parallelize a single-device `VisionEncoder` (`parallelize_encoder`) or `Qwen3VLVision`
(`parallelize_qwen3_vl_vision`) in place for one rank of an encoder layout (`dp × tp`), and say
how its gradients are reduced and counted.

Tensor parallelism: attention heads (fused qkv split block by block) and the MLP hidden split
column/row-wise, and the projector (Qwen3-VL's patch merger and DeepStack mergers) likewise;
images are split over dp. Every gradient is summed over dp: tp ranks hold shards or identical
replicas.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from dyad.encoder_service.model import hold_key_bias
from dyad.parallel.gradients import GradientPlan, is_sharded
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def parallelize_encoder(model: nn.Module, groups: ProcessGroups) -> GradientPlan:
    if groups.layout.tp > 1:
        tp_group = groups.group("tp")
        for block in model.blocks:
            _split_block(block, tp_group)
            hold_key_bias(block.qkv)
        _split_mlp(model, "proj_in", "proj_out", tp_group)
    return _gradient_plan(model, groups)


def parallelize_qwen3_vl_vision(model: nn.Module, groups: ProcessGroups) -> GradientPlan:
    if groups.layout.tp > 1:
        tp_group = groups.group("tp")
        for block in model.blocks:
            _split_block(block, tp_group)
        for merger in [model.merger, *model.deepstack_mergers]:  # each one's norm whole on every rank
            _split_mlp(merger, "fc1", "fc2", tp_group)
    return _gradient_plan(model, groups)


def _gradient_plan(model: nn.Module, groups: ProcessGroups) -> GradientPlan:
    plan = GradientPlan(reduce_over={"dp": list(model.parameters())})
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if is_sharded(module, name) or groups.index("tp") == 0:
                plan.counted.append(param)
    return plan


def _split_block(block: nn.Module, tp_group) -> None:
    """Its heads (q, k and v each split by heads) and its MLP's hidden over the tp ranks."""
    block.qkv = ColumnParallelLinear(block.qkv, tp_group, parts=3)
    block.proj = RowParallelLinear(block.proj, tp_group)
    _split_mlp(block, "fc1", "fc2", tp_group)
    block.heads //= dist.get_world_size(tp_group)


def _split_mlp(module: nn.Module, up: str, down: str, tp_group) -> None:
    """The hidden between two of `module`'s linears over the tp ranks: `up` column-parallel,
    `down` row-parallel."""
    setattr(module, up, ColumnParallelLinear(getattr(module, up), tp_group))
    setattr(module, down, RowParallelLinear(getattr(module, down), tp_group))
