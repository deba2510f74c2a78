"""Tensor parallelism applied from outside: the sharded layers that replace a single-device
module's Linear / Embedding, built from the module's full weights, and the loss over the
vocabulary they split. Each layer says how its parameters are cut (`ShardedParameters`). The
collectives are `dyad/parallel/collectives.py`'s autograd family.

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
    gather_from_group,
    own_chunk,
    reduce_from_group,
    reduce_scatter_to_group,
    split_to_group,
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


class VocabParallelEmbedding(nn.Module, ShardedParameters):
    """Embedding rows split over the group (padded to equal slices); lookups outside this rank's
    slice give zeros and the partial results are summed."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        self.group = group
        self.full_rows = embedding.num_embeddings
        self.weight = nn.Parameter(self.local_part("weight", embedding.weight.detach()))
        self.vocab_start = dist.get_rank(group) * self.weight.shape[0]

    def cuts(self, owner: nn.Module, name: str) -> bool:
        return owner is self

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full table (zero-padded past the vocabulary)."""
        return shard_rows(full, dist.get_world_size(self.group), dist.get_rank(self.group))

    def gather_full(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return all_gather_cat(value, self.group, 0)[: self.full_rows]

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(h, self.group)


class _VocabParallelCrossEntropySum(torch.autograd.Function):
    """Sum over non-ignored tokens of -log softmax(logits)[target], with the vocabulary split over
    the group; each rank holds logits_TVl for its slice starting at `vocab_start`."""

    @staticmethod
    def forward(ctx, logits_TVl, targets_T, group, vocab_start, vocab_size, ignore_index):
        logits = logits_TVl.float()
        Vl = logits.shape[-1]
        real = torch.arange(vocab_start, vocab_start + Vl, device=logits.device) < vocab_size
        logits = logits.masked_fill(~real, float("-inf"))  # padding rows of the last slice
        max_T = logits.max(dim=-1).values
        dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - max_T.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp_T = exp.sum(dim=-1)
        dist.all_reduce(sum_exp_T, group=group)

        valid_T = targets_T != ignore_index
        local_T = targets_T - vocab_start
        mine_T = valid_T & (local_T >= 0) & (local_T < Vl)
        index_T = local_T.clamp(0, Vl - 1)
        target_logit_T = shifted.gather(-1, index_T.unsqueeze(-1)).squeeze(-1) * mine_T
        dist.all_reduce(target_logit_T, group=group)

        loss_T = (sum_exp_T.log() - target_logit_T) * valid_T
        ctx.save_for_backward(exp / sum_exp_T.unsqueeze(-1), index_T, mine_T, valid_T)
        ctx.input_dtype = logits_TVl.dtype
        return loss_T.sum()

    @staticmethod
    def backward(ctx, grad):
        softmax_TVl, index_T, mine_T, valid_T = ctx.saved_tensors
        grad_TVl = softmax_TVl.clone()
        rows = torch.arange(grad_TVl.shape[0], device=grad_TVl.device)
        grad_TVl[rows, index_T] -= mine_T.to(grad_TVl.dtype)
        grad_TVl *= valid_T.unsqueeze(-1) * grad
        return grad_TVl.to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy_sum(
    logits_BSVl, targets_BS, group, *, vocab_start: int, vocab_size: int, ignore_index: int = -100
) -> torch.Tensor:
    Vl = logits_BSVl.shape[-1]
    return _VocabParallelCrossEntropySum.apply(
        logits_BSVl.reshape(-1, Vl), targets_BS.reshape(-1), group, vocab_start, vocab_size, ignore_index
    )


class VocabParallelCrossEntropy(nn.Module):
    """The summed cross-entropy of logits whose vocabulary a `ColumnParallelLinear` output layer
    splits over the group (replaces the model's single-device caption loss)."""

    def __init__(self, output: ColumnParallelLinear, vocab_size: int):
        super().__init__()
        self.group, self.vocab_size = output.group, vocab_size
        self.vocab_start = dist.get_rank(output.group) * output.weight.shape[0]

    def forward(self, logits_BSVl: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy_sum(
            logits_BSVl, targets_BS, self.group, vocab_start=self.vocab_start, vocab_size=self.vocab_size
        )


class SequenceParallel:
    """The decoder layers' residual stream split along the sequence over the tensor-parallel
    group (replaces `MoELM.sequence`): norms and residual adds run on 1/tp of the tokens; the
    column-parallel layers gather the sequence, the row-parallel ones scatter it back."""

    def __init__(self, group):
        self.group = group

    def scatter(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return split_to_group(h_BSD, self.group, 1)

    def columns(self, x_BS: torch.Tensor) -> torch.Tensor:
        return own_chunk(x_BS, self.group, 1)

    def gather(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return gather_from_group(h_BSD, self.group, 1)
