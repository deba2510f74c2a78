"""The pools' gradient reduction sums in place, a bucket of gradients per all-reduce: the same
sums as one flat buffer, whatever the bucket size, with the parameters' own grad tensors."""

from __future__ import annotations

import torch
from torch import nn

from dyad.layout import LLMLayout
from dyad.parallel.gradients import GradientPlan, gradient_buckets, reduce_gradients
from dyad.parallel.groups import ProcessGroups
from tests.helpers.distributed import run_distributed

SHAPES = [(3, 5), (7,), (40, 10), (2, 3, 4), (1,), (6, 6)]  # (40, 10): larger than the bucket below
SMALL_BUCKET_BYTES = 64 * 4  # 64 float32 values


def _gradient(rank: int, index: int, shape, dtype) -> torch.Tensor:
    """Small integers: their sums are exact in any order, so the check can be equality."""
    numel = torch.Size(shape).numel()
    return (torch.arange(numel) % 7 + 10 * rank + index).reshape(shape).to(dtype)


def _params(rank: int) -> list[nn.Parameter]:
    params = []
    for index, shape in enumerate(SHAPES):
        dtype = torch.float64 if index == 3 else torch.float32  # a dtype change splits buckets
        param = nn.Parameter(torch.zeros(shape, dtype=dtype))
        if index == 4:  # no gradient on any rank: zeros after the sum
            params.append(param)
            continue
        grad = _gradient(rank, index, shape, dtype)
        param.grad = grad.t() if index == 5 else grad  # a transposed (non-contiguous) gradient
        params.append(param)
    return params


def _summed(world_size: int) -> list[torch.Tensor]:
    expected = []
    for index, shape in enumerate(SHAPES):
        dtype = torch.float64 if index == 3 else torch.float32
        if index == 4:
            expected.append(torch.zeros(shape, dtype=dtype))
            continue
        total = sum(_gradient(rank, index, shape, dtype) for rank in range(world_size))
        expected.append(total.t() if index == 5 else total)
    return expected


def _reduce_and_check(rank: int, world_size: int, bucket_bytes: int) -> None:
    groups = ProcessGroups.build(LLMLayout(dp=world_size))
    params = _params(rank)
    before = [param.grad for param in params]
    reduce_gradients(GradientPlan(reduce_over={"dp": params}), groups, bucket_bytes)
    for index, (param, expected) in enumerate(zip(params, _summed(world_size))):
        assert torch.equal(param.grad, expected), f"parameter {index}: {param.grad} != {expected}"
        if before[index] is not None:
            assert param.grad is before[index], f"parameter {index}: its grad tensor was replaced"


def test_three_ranks_sum_in_place_in_small_buckets():
    run_distributed(_reduce_and_check, 3, SMALL_BUCKET_BYTES)


def test_three_ranks_sum_in_place_in_one_bucket():
    run_distributed(_reduce_and_check, 3, 2**30)


def test_buckets_hold_consecutive_gradients_of_one_dtype_up_to_the_size():
    grads = [torch.zeros(n, dtype=dtype) for n, dtype in
             [(10, torch.float32), (50, torch.float32), (100, torch.float32), (4, torch.float32),
              (4, torch.float64), (4, torch.float32)]]
    buckets = list(gradient_buckets(grads, SMALL_BUCKET_BYTES))
    assert [[g.numel() for g in bucket] for bucket in buckets] == [[10, 50], [100], [4], [4], [4]]
    in_order = [g for bucket in buckets for g in bucket]
    assert len(in_order) == len(grads) and all(a is b for a, b in zip(in_order, grads))
