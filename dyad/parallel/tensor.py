"""Tensor parallelism applied from outside: the sharded linears that replace a single-device
module's Linear, built from the module's full weights (the LLM's vocabulary-split embedding and
loss are its own: dyad/llm_service/tensor_parallel.py). Each layer says how its parameters are
cut (`ShardedParameters`). The collectives are `dyad/parallel/collectives.py`'s autograd family.

Convention (Megatron's): activations outside a tensor-parallel region are replicated on every rank
of the group and carry identical gradients. A column-parallel layer enters the region (identity
forward, all-reduce of the input gradient backward); a row-parallel layer leaves it (all-reduce of
the partial outputs forward, identity backward).

Legend: T tokens, D model dim, O output features, V vocabulary (Vl: this rank's slice).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dyad.parallel.collectives import (
    all_gather_cat,
    all_gather_sum_grad,
    copy_to_group,
    reduce_from_group,
    reduce_scatter_to_group,
)
from dyad.parallel.sharded import ShardedParameters


def shard_rows(full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Rows [rank*n, (rank+1)*n) of `full` with n = ceil(rows/size), zero-padded past the end."""
    per_rank = math.ceil(full.shape[0] / size)
    local = full.new_zeros((per_rank, *full.shape[1:]))
    rows = full[rank * per_rank : (rank + 1) * per_rank]
    local[: rows.shape[0]] = rows
    return local


class ColumnParallelLinear(nn.Module, ShardedParameters):
    """y_TOl = x_TD @ W[rows of this rank].T: output features split over the group (the last
    slice zero-padded when they do not divide, as for a vocabulary). A fused projection of
    `parts` equal blocks (e.g. q, k, v) is split block by block, so each rank keeps its heads
    of every block."""

    def __init__(self, linear: nn.Linear, group, *, parts: int = 1, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.parts, self.sequence_parallel = group, parts, sequence_parallel
        self.full_rows = linear.out_features
        self.weight = nn.Parameter(self.local_part("weight", linear.weight.detach()))
        self.bias = None if linear.bias is None else nn.Parameter(self.local_part("bias", linear.bias.detach()))

    def cuts(self, owner: nn.Module, name: str) -> bool:
        return owner is self

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full weight or bias (or of a tensor shaped like one)."""
        return _shard_parts(full, self.parts, dist.get_world_size(self.group), dist.get_rank(self.group))

    def gather_full(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return self.unshard(all_gather_cat(value, self.group, 0))

    def forward(self, x):
        if self.sequence_parallel:  # x holds this rank's part of the sequence (dim -2)
            x = all_gather_sum_grad(x, self.group, x.dim() - 2)
        else:
            x = copy_to_group(x, self.group)
        return F.linear(x, self.weight, self.bias)

    def unshard(self, gathered: torch.Tensor) -> torch.Tensor:
        """Full rows from every rank's slice concatenated along dim 0 (rank order)."""
        if self.parts == 1:
            return gathered[: self.full_rows]
        size = dist.get_world_size(self.group)
        blocks = gathered.reshape(size, self.parts, -1, *gathered.shape[1:]).transpose(0, 1)
        return blocks.reshape(self.full_rows, *gathered.shape[1:])


def _shard_parts(full: torch.Tensor, parts: int, size: int, rank: int) -> torch.Tensor:
    if parts == 1:
        return shard_rows(full, size, rank)
    blocks = full.reshape(parts, -1, *full.shape[1:])
    return torch.cat([block.chunk(size, dim=0)[rank] for block in blocks]).clone()


class RowParallelLinear(nn.Module, ShardedParameters):
    """y_TO = sum over ranks of x_TDl @ W[:, columns of this rank].T (+ bias once). With sequence
    parallelism the sum is scattered: each rank keeps its part of the sequence (dim -2)."""

    def __init__(self, linear: nn.Linear, group, *, sequence_parallel: bool = False):
        super().__init__()
        size = dist.get_world_size(group)
        if linear.in_features % size:
            raise ValueError(f"{linear.in_features} input features do not split over {size} ranks")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(self.local_part("weight", linear.weight.detach()).clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def cuts(self, owner: nn.Module, name: str) -> bool:
        return owner is self and name == "weight"  # the bias is whole on every rank

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full weight (or of a tensor shaped like it)."""
        return full.chunk(dist.get_world_size(self.group), dim=1)[dist.get_rank(self.group)]

    def gather_full(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return all_gather_cat(value, self.group, 1)

    def forward(self, x_local):
        y = F.linear(x_local, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_group(y, self.group, y.dim() - 2)
        else:
            y = reduce_from_group(y, self.group)
        return y if self.bias is None else y + self.bias
