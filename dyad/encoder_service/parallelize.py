"""Parallelize a single-device `VisionEncoder` in place for one rank of an encoder layout
(`dp × tp`), and say how its gradients are reduced and counted.

Tensor parallelism: attention heads (fused qkv split block by block) and the MLP hidden split
column/row-wise, and the projector likewise; images are split over dp. Every gradient is summed
over dp: tp ranks hold shards or identical replicas.
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
        _apply_tensor_parallel(model, groups.group("tp"))
    plan = GradientPlan(reduce_over={"dp": list(model.parameters())})
    first_in_dp = groups.index("dp") == 0
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if first_in_dp and (is_sharded(module, name) or groups.index("tp") == 0):
                plan.counted.append(param)
    return plan


def _apply_tensor_parallel(model: nn.Module, tp_group) -> None:
    tp = dist.get_world_size(tp_group)
    for block in model.blocks:
        block.qkv = ColumnParallelLinear(block.qkv, tp_group, parts=3)
        hold_key_bias(block.qkv)
        block.proj = RowParallelLinear(block.proj, tp_group)
        block.fc1 = ColumnParallelLinear(block.fc1, tp_group)
        block.fc2 = RowParallelLinear(block.fc2, tp_group)
        block.heads //= tp
    model.proj_in = ColumnParallelLinear(model.proj_in, tp_group)
    model.proj_out = RowParallelLinear(model.proj_out, tp_group)
