"""Collectives that return a new tensor, for the forwards (and backwards) of autograd.Functions.

Eagerly each is torch.distributed's op (c10d) writing a fresh output. Under torch.compile each is
the functional collective instead (`torch.distributed._functional_collectives`), whose output
dynamo traces as an op's output. Dynamo rewrites a c10d op into a functional one plus a copy back
into the tensor it was given; an autograd.Function whose forward returns that tensor loses its
backward in torch 2.11, the GPU hosts' version (the compiled gradients through it are wrong,
zeros in a plain case, and nothing fails; torch 2.13 gets them right). Sizes along dim 0 are
per rank (`splits`) or equal blocks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# torch 2.13 renamed the single-tensor collectives (the old names warn there); torch 2.11 has
# only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Block r (of equal blocks along dim 0) of the sum of every rank's `x`, on rank r."""
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, group)
    out = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows in_splits[r] of `x` (consecutive blocks) to rank r; out_splits[r] rows from rank r."""
    if torch.compiler.is_compiling():
        return funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group)
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out
