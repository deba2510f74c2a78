"""Collectives that return a new tensor, for the forwards (and backwards) of autograd.Functions.

Eagerly each is torch.distributed's op (c10d) writing a fresh output. Under torch.compile each is
the functional collective instead (`torch.distributed._functional_collectives`), whose output
dynamo traces as an op's output. Dynamo rewrites a c10d op into a functional one plus a copy back
into the tensor it was given; an autograd.Function whose forward returns that tensor loses its
backward in torch 2.11, the GPU hosts' version (the compiled gradients through it are wrong,
zeros in a plain case, and nothing fails; torch 2.13 gets them right). Sizes along dim 0 are
per rank (`splits`) or equal blocks.

Below them, the one family of autograd collectives that tensor, context and expert parallelism
share. Each names its forward; its backward is the forward's adjoint for how the result is used:
- `copy_to_group` (identity; backward all-reduce) enters a region whose ranks use a replicated
  input differently; `reduce_from_group` (all-reduce; backward identity) leaves it;
  `all_reduce_sum_grad` (all-reduce both ways) sums values each rank then uses differently.
- `split_to_group` (this rank's chunk; backward all-gather) and `gather_from_group` (all-gather;
  backward this rank's chunk) move between replicated and split values with replicated gradients.
- `all_gather_sum_grad` (all-gather; backward reduce-scatter) and `reduce_scatter_to_group`
  (reduce-scatter; backward all-gather) for values each rank uses differently; both take
  per-rank row counts (`sizes`, along dim 0) where the ranks' rows differ.
- `all_to_all` (rows to each rank; backward the reversed all-to-all).
A group of one rank, or None ("no group"), leaves the tensor as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dyad.kernels.traceable import as_contiguous

# torch 2.13 renamed the single-tensor collectives (the old names warn there); torch 2.11 has
# only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's `x`."""
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x.contiguous(), "sum", group)
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def all_gather_cat(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank's `x` (all of one shape), concatenated along `dim` in rank order."""
    if torch.compiler.is_compiling():  # along dim 0, then moved: torch 2.11 does not trace the move
        stacked = funcol.all_gather_tensor(x.contiguous(), 0, group)
        if dim == 0:
            return stacked
        return torch.cat(stacked.chunk(dist.get_world_size(group), dim=0), dim=dim)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `x` (all of one shape) stacked along dim 0: [ranks * rows, ...]."""
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(x.contiguous(), 0, group)
    out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Block r (of equal blocks along dim 0) of the sum of every rank's `x`, on rank r."""
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, group)
    out = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows in_splits[r] of `x` (consecutive blocks) to rank r; out_splits[r] rows from rank r."""
    if torch.compiler.is_compiling():
        return funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group)
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


# ---- the autograd family -------------------------------------------------------------------------


def group_size(group: dist.ProcessGroup | None) -> int:
    """None means "no group" here (not torch's default world group)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def own_chunk(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's equal chunk of `x` along `dim` (a view where it is contiguous already)."""
    return as_contiguous(x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)])


def _gather(x: torch.Tensor, group, dim: int, sizes: list[int] | None) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`; with `sizes`, rank i's sizes[i] rows (dim 0),
    padded to the largest for the collective."""
    if sizes is None:
        return all_gather_cat(x, group, dim)
    rows_max = max(sizes)
    if rows_max == 0:
        return x.new_empty(0, *x.shape[1:])
    padded = x.new_zeros(rows_max, *x.shape[1:])
    padded[: x.shape[0]] = x
    out = all_gather_rows(padded, group)
    if min(sizes) == rows_max:
        return out
    return torch.cat([out[i * rows_max : i * rows_max + n] for i, n in enumerate(sizes)])


def _reduce_scatter(x: torch.Tensor, group, dim: int, sizes: list[int] | None) -> torch.Tensor:
    """The sum over ranks, of which this rank keeps its chunk along `dim`; with `sizes`, block i
    (sizes[i] rows of the concatenation, dim 0) goes to rank i."""
    if sizes is None:
        return own_chunk(all_reduce_sum(x, group), group, dim)
    rows_max = max(sizes)
    if rows_max == 0:
        return x.new_empty(0, *x.shape[1:])
    padded = x.new_zeros(len(sizes) * rows_max, *x.shape[1:])
    start = 0
    for i, n in enumerate(sizes):
        padded[i * rows_max : i * rows_max + n] = x[start : start + n]
        start += n
    return reduce_scatter_rows(padded, group)[: sizes[dist.get_rank(group)]]


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceSumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group), None


class _SplitToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_cat(grad, ctx.group, ctx.dim), None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return own_chunk(grad, ctx.group, ctx.dim), None, None


class _AllGatherSumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _ReduceScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _reduce_scatter(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all_rows(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return all_to_all_rows(grad, in_splits, out_splits, ctx.group), None, None, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def all_reduce_sum_grad(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group, whose backward sums every rank's gradient of it (each rank's result
    feeds a different loss term, as torch.distributed.nn's all_reduce)."""
    return x if group_size(group) == 1 else _AllReduceSumGrad.apply(x, group)


def split_to_group(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return x if group_size(group) == 1 else _SplitToGroup.apply(x, group, dim)


def gather_from_group(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromGroup.apply(x, group, dim)


def all_gather_sum_grad(x: torch.Tensor, group, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
    """All-gather along `dim` (with `sizes`: sizes[i] rows from rank i, dim 0); the backward sums
    every rank's gradient of the gathered tensor and keeps this rank's part (a reduce-scatter)."""
    return x if group_size(group) == 1 else _AllGatherSumGrad.apply(x, group, dim, sizes)


def reduce_scatter_to_group(x: torch.Tensor, group, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
    """The sum over the group, this rank's chunk of it along `dim` (with `sizes`: block i of
    sizes[i] rows to rank i, dim 0); the backward all-gathers the chunks' gradients."""
    return x if group_size(group) == 1 else _ReduceScatterToGroup.apply(x, group, dim, sizes)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows in_splits[r] of `x` to rank r, out_splits[r] rows from rank r; backward the reverse."""
    return x if group_size(group) == 1 else _AllToAll.apply(x, out_splits, in_splits, group)
