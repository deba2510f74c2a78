"""The multi-rank harness itself: ranks run, and a failing rank fails the test."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size))


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one fails")


def test_ranks_run_collectives():
    run_distributed(_sum_ranks, 4)


def test_a_failing_rank_fails_the_test():
    with pytest.raises(AssertionError, match="rank one fails"):
        run_distributed(_fail_on_rank_one, 2, timeout_s=60)
