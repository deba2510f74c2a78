"""The LLM's own tensor-parallel counterparts: the embedding and the loss over a vocabulary split
over the tensor-parallel group, and the residual stream split along the sequence (sequence
parallelism). The linears they work with are `dyad/parallel/tensor.py`'s, which the encoder
shares.

Legend: T tokens, B sequences, S positions, D model dim, V vocabulary (Vl: this rank's slice).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dyad.parallel.collectives import (
    all_gather_cat,
    all_gather_sum_grad,
    all_reduce_sum_grad,
    copy_to_group,
    gather_from_group,
    own_chunk,
    reduce_from_group,
    split_to_group,
)
from dyad.parallel.sharded import ShardedParameters
from dyad.parallel.tensor import ColumnParallelLinear, shard_rows


class VocabParallelEmbedding(nn.Module, ShardedParameters):
    """Embedding rows split over the group (padded to equal slices); lookups outside this rank's
    slice give zeros and the partial results are summed. The embedding's `padding_idx` row, on
    the rank that holds it, learns nothing, as in the whole table."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        self.group = group
        self.full_rows = embedding.num_embeddings
        self.weight = nn.Parameter(self.local_part("weight", embedding.weight.detach()))
        self.vocab_start = dist.get_rank(group) * self.weight.shape[0]
        local_pad = -1 if embedding.padding_idx is None else embedding.padding_idx - self.vocab_start
        self.local_padding_idx = local_pad if 0 <= local_pad < self.weight.shape[0] else None

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
        h = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=self.local_padding_idx)
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


class VocabParallelPredictedTargets(nn.Module):
    """Where each target is the argmax of logits whose vocabulary a `ColumnParallelLinear` output
    layer splits over the group: the first of equal maxima over the whole vocabulary, as
    `torch.argmax` of the gathered logits (replaces the model's `PredictedTargets`)."""

    def __init__(self, output: ColumnParallelLinear, vocab_size: int):
        super().__init__()
        self.group, self.vocab_size = output.group, vocab_size
        self.vocab_start = dist.get_rank(output.group) * output.weight.shape[0]

    def forward(self, logits_BSVl: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        Vl = logits_BSVl.shape[-1]
        real_Vl = torch.arange(self.vocab_start, self.vocab_start + Vl, device=logits_BSVl.device) < self.vocab_size
        local_max_BS, local_index_BS = logits_BSVl.float().masked_fill(~real_Vl, -torch.inf).max(dim=-1)
        max_BS = local_max_BS.clone()
        dist.all_reduce(max_BS, op=dist.ReduceOp.MAX, group=self.group)
        # The lowest vocabulary index holding the maximum: `max` gives each slice's first.
        beyond = torch.iinfo(torch.long).max
        index_BS = torch.where(local_max_BS == max_BS, local_index_BS + self.vocab_start, beyond)
        dist.all_reduce(index_BS, op=dist.ReduceOp.MIN, group=self.group)
        return index_BS == targets_BS


class ProjectionParallelRMSNorm(nn.Module, ShardedParameters):
    """An RMSNorm over a projection whose heads a column-parallel linear splits over the group
    (replaces `ProjectionNorm`): the mean square over every rank's features, this rank's slice of
    the weight."""

    def __init__(self, norm: nn.RMSNorm, group):
        super().__init__()
        self.group, self.eps, self.features = group, norm.eps, norm.weight.shape[0]
        self.weight = nn.Parameter(self.local_part("weight", norm.weight.detach()))

    def cuts(self, owner: nn.Module, name: str) -> bool:
        return owner is self

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return shard_rows(full, dist.get_world_size(self.group), dist.get_rank(self.group))

    def gather_full(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return all_gather_cat(value, self.group, 0)[: self.features]

    def forward(self, x_BSHDh: torch.Tensor) -> torch.Tensor:
        x_BSF = x_BSHDh.flatten(-2).float()
        sq_sum_BS1 = all_reduce_sum_grad(x_BSF.square().sum(-1, keepdim=True), self.group)
        y_BSF = x_BSF * torch.rsqrt(sq_sum_BS1 / self.features + self.eps) * self.weight.float()
        return y_BSF.to(x_BSHDh.dtype).view_as(x_BSHDh)


class EnterHeadParallel(nn.Module):
    """Where a value every rank's heads use enters the head-parallel region (replaces
    `LatentAttention.rope_key`, the rotary key all heads share): the backward sums the ranks'
    gradients, as a column-parallel layer's does for its input; with sequence parallelism the
    forward also gathers the sequence (and the backward scatters it)."""

    def __init__(self, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x_BSX: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x holds this rank's part of the sequence (dim -2)
            return all_gather_sum_grad(x_BSX, self.group, x_BSX.dim() - 2)
        return copy_to_group(x_BSX, self.group)


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

    def rows(self, rows_ND: torch.Tensor, positions_N: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at flat positions into B*S (every rank's the same) as this rank's part of the
        stream adds them: its own at their flat positions into B*(S/tp), the others' as zeros at
        position 0 (no host sync to pick them out). Their gradients are summed over the group:
        each rank's rows get theirs whole, as the spliced image rows do."""
        tp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        Sl = S // tp
        b_N, s_N = positions_N // S, positions_N % S - rank * Sl
        held_N = (s_N >= 0) & (s_N < Sl)
        rows_ND = copy_to_group(rows_ND, self.group) * held_N.unsqueeze(1)
        return rows_ND, torch.where(held_N, b_N * Sl + s_N, 0)

    def gather(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return gather_from_group(h_BSD, self.group, 1)
