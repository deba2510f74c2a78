"""`dyad/parallel/collectives.py`: each collective gives the same values eagerly and compiled, and
an autograd.Function whose forward returns one keeps its gradient when compiled (on torch 2.11,
the GPU hosts' version, a forward returning the tensor an in-place c10d all-reduce wrote gives
zero gradients compiled; tests/dist/test_llm_layouts.py checks whole compiled layouts)."""

from __future__ import annotations

import torch

from dyad.parallel.collectives import (
    all_gather_cat,
    all_gather_rows,
    all_reduce_sum,
    all_to_all_rows,
    reduce_scatter_rows,
)
from tests.helpers.distributed import run_distributed


def _each_collective(x, group, rank, world):
    out_splits = [rank + 1] * world  # rank r sends r' + 1 rows to rank r'
    in_splits = [r + 1 for r in range(world)]
    rows = x.repeat(sum(in_splits), 1)[: sum(in_splits)]
    return {
        "all_reduce_sum": all_reduce_sum(x, group),
        "all_gather_cat dim 1": all_gather_cat(x, group, 1),
        "all_gather_rows": all_gather_rows(x, group),
        "reduce_scatter_rows": reduce_scatter_rows(torch.cat([x] * world), group),
        "all_to_all_rows": all_to_all_rows(rows * (rank + 1), out_splits, in_splits, group),
    }


def _values_body(rank, world):
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    group = torch.distributed.group.WORLD
    eager = _each_collective(x, group, rank, world)
    torch._dynamo.reset()
    compiled = torch.compile(_each_collective, backend="eager", fullgraph=True)(x, group, rank, world)
    total = sum(torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r for r in range(world))
    torch.testing.assert_close(eager["all_reduce_sum"], total)
    torch.testing.assert_close(eager["reduce_scatter_rows"], total)
    gathered = [torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r for r in range(world)]
    torch.testing.assert_close(eager["all_gather_cat dim 1"], torch.cat(gathered, dim=1))
    torch.testing.assert_close(eager["all_gather_rows"], torch.cat(gathered))
    assert eager["all_to_all_rows"].shape == (world * (rank + 1), 3)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], msg=name)


def test_each_collective_gives_the_same_values_eagerly_and_compiled():
    run_distributed(_values_body, 2)


class _Summed(torch.autograd.Function):
    """Forward: the sum over the ranks. Backward: the gradient as it is (as a row-parallel
    linear's reduction has it)."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce_sum(x, torch.distributed.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _gradient_body(rank, world):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank), requires_grad=True)

    def loss(t):
        return (_Summed.apply(t * 2) * (rank + 1)).square().sum()

    (eager,) = torch.autograd.grad(loss(x), x)
    torch._dynamo.reset()
    (compiled,) = torch.autograd.grad(torch.compile(loss, backend="aot_eager")(x), x)
    assert eager.abs().sum() > 0
    torch.testing.assert_close(compiled, eager)


def test_a_compiled_function_returning_a_collective_keeps_its_gradient():
    run_distributed(_gradient_body, 2)
