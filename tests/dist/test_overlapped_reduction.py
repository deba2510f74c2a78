"""The pools' gradient reduction (dyad/parallel/overlap.py) against the reduction after backward
(`reduce_gradients`), on three gloo ranks: the same sums, buckets sent while the armed backward
pass runs and not before (all at `finish()` without overlap), a gradient no hook reports (as the
expert GEMMs add theirs) summed at `finish()`, and no more flat copies in flight than allowed;
and so with the sharded optimizer's buckets, which reduce-scatter into each rank's pieces.

Weights, inputs and upstream gradients are small integers, so every gradient and every sum is
exact in any order and the checks can be equality."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from torch import nn

from dyad.layout import LLMLayout
from dyad.parallel.gradients import GradientPlan, reduce_gradients
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.overlap import GradientReduction
from dyad.parallel.sharded_optimizer import ShardedOptimizer
from tests.helpers.distributed import run_distributed

WIDTHS = [6, 8, 8, 8, 5]
BUCKET_BYTES = 8 * 8 * 4  # one 8 x 8 float32 weight: most layers are buckets of their own


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randint(-2, 3, layer.weight.shape))
            layer.bias.copy_(torch.randint(-2, 3, layer.bias.shape))
    return nn.Sequential(*layers)


def _backward(model: nn.Module, rank: int, microbatch: int) -> None:
    generator = torch.Generator().manual_seed(10 * rank + microbatch)
    x = torch.randint(-3, 4, (4, WIDTHS[0]), generator=generator).float()
    upstream = torch.randint(-2, 3, (4, WIDTHS[-1]), generator=generator).float()
    (model(x) * upstream).sum().backward()


def _two_microbatches(rank: int, world_size: int, max_copies: int, overlap: bool = True) -> None:
    groups = ProcessGroups.build(LLMLayout(dp=world_size))
    model = _model()
    reference = copy.deepcopy(model)
    reduction = GradientReduction(GradientPlan(reduce_over={"dp": list(model.parameters())}), groups,
                                    bucket_bytes=BUCKET_BYTES, max_copies_in_flight=max_copies, overlap=overlap)
    [lane] = reduction.lanes
    _backward(model, rank, 0)
    assert lane.next == 0 and not reduction.sent, "a bucket went before the reduction was armed"
    reduction.arm()
    _backward(model, rank, 1)
    if overlap:
        assert lane.next == len(lane.buckets), "the armed backward reported every gradient: all should be sent"
    else:
        assert lane.next == 0, "overlap=False sends nothing before finish()"
    assert sum(sent.flat is not None for sent in reduction.sent) <= max_copies
    reduction.finish()

    for microbatch in (0, 1):
        _backward(reference, rank, microbatch)
    reduce_gradients(GradientPlan(reduce_over={"dp": list(reference.parameters())}), groups)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param.grad, expected.grad), f"{name}: {param.grad} != {expected.grad}"
    assert lane.next == 0 and not reduction.sent, "finish() leaves the reduction ready for the next step"


def test_overlapped_sums_equal_the_sums_after_backward_and_go_during_the_armed_pass():
    run_distributed(_two_microbatches, 3, 2)


def test_at_most_one_flat_copy_in_flight_when_so_bounded():
    run_distributed(_two_microbatches, 3, 1)


def test_without_overlap_every_bucket_goes_at_finish_with_the_same_sums():
    run_distributed(_two_microbatches, 3, 2, False)


def _a_gradient_no_hook_reports(rank: int, world_size: int) -> None:
    """An extra parameter whose gradient is written into .grad directly after backward (as
    dyad/kernels/expert_weight_grads.py does), placed so that its bucket comes first in the order:
    nothing may go during the pass, and finish() sums it with the rest."""
    groups = ProcessGroups.build(LLMLayout(dp=world_size))
    model = _model()
    outside = nn.Parameter(torch.zeros(3, 3))
    params = [*model.parameters(), outside]  # buckets go in reverse order: `outside` first
    reduction = GradientReduction(GradientPlan(reduce_over={"dp": params}), groups, bucket_bytes=BUCKET_BYTES)
    [lane] = reduction.lanes
    reduction.arm()
    _backward(model, rank, 0)
    assert lane.next == 0, "the bucket of a gradient no hook reported held back the rest"
    outside.grad = torch.full((3, 3), float(rank + 1))
    reduction.finish()
    assert torch.equal(outside.grad, torch.full((3, 3), float(sum(range(1, world_size + 1)))))
    reference = _model()
    _backward(reference, rank, 0)
    reduce_gradients(GradientPlan(reduce_over={"dp": list(reference.parameters())}), groups)
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert torch.equal(param.grad, expected.grad)


def test_a_gradient_written_outside_autograd_holds_its_bucket_until_finish_and_is_summed():
    run_distributed(_a_gradient_no_hook_reports, 3)


def _sharded(rank: int, world_size: int) -> None:
    """The sharded optimizer's buckets (uneven pieces: 3 ranks) go during the armed pass, at most
    one copy in flight; each rank's pieces then hold its chunks of the sums, whole again when
    gathered, and the parameters no gradient."""
    groups = ProcessGroups.build(LLMLayout(dp=world_size))
    model = _model()
    reference = copy.deepcopy(model)
    plan = GradientPlan(reduce_over={"dp": list(model.parameters())}, counted=list(model.parameters()))
    train = argparse.Namespace(lr=0.1, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
    shards = ShardedOptimizer(plan, groups, train, bucket_bytes=BUCKET_BYTES)
    reduction = GradientReduction(plan, groups, max_copies_in_flight=1, into=shards)
    [lane] = reduction.lanes
    assert len(lane.buckets) > 2
    _backward(model, rank, 0)
    assert lane.next == 0 and not reduction.sent, "a bucket went before the reduction was armed"
    reduction.arm()
    _backward(model, rank, 1)
    assert lane.next == len(lane.buckets), "the armed backward reported every gradient: all should be sent"
    assert sum(sent.flat is not None for sent in reduction.sent) <= 1
    reduction.finish()

    for microbatch in (0, 1):
        _backward(reference, rank, microbatch)
    reduce_gradients(GradientPlan(reduce_over={"dp": list(reference.parameters())}), groups)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is None, name
        assert torch.equal(shards.value(param, "grad"), expected.grad), name
    expected = sum(float(p.grad.double().square().sum()) for p in reference.parameters())
    assert shards.grad_sq_norm() == pytest.approx(expected, rel=1e-6)  # float32 norms of the pieces


def test_sharded_buckets_reduce_scatter_into_each_ranks_pieces_during_the_armed_pass():
    run_distributed(_sharded, 3)
