"""`dyad/kernels/traceable.py`: casts and layout changes that would change nothing are not traced, and
an autograd.Function returning their results keeps its gradient under torch.compile.

The gradient check is what fails on torch 2.11 (the GPU hosts' version) with plain `.to()` /
`.contiguous()`: the compiled backward returns zeros there. torch 2.13 computes it either way,
so on it the graph checks below are what guards the helpers."""

from __future__ import annotations

import pytest
import torch

from dyad.kernels.traceable import as_contiguous, to_dtype


def _traced_ops(fn, *args) -> set[str]:
    """Names of the methods and functions dynamo records for fn(*args), in one graph."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=recording_backend, fullgraph=True)(*args)
    return {getattr(node.target, "__name__", str(node.target)) for g in graphs for node in g.graph.nodes}


def test_a_cast_to_the_same_dtype_is_not_traced_and_a_real_one_is():
    x = torch.randn(4, 3)
    assert "to" not in _traced_ops(lambda t: to_dtype(t * 2, torch.float32), x)
    assert "to" in _traced_ops(lambda t: to_dtype(t * 2, torch.bfloat16), x)
    assert to_dtype(x, torch.float32) is x
    assert to_dtype(x, torch.bfloat16).dtype == torch.bfloat16


def test_contiguous_is_traced_only_for_a_tensor_that_is_not():
    x = torch.randn(4, 6)
    assert "contiguous" not in _traced_ops(lambda t: as_contiguous((t * 2).chunk(2, dim=0)[1]), x)
    assert "contiguous" in _traced_ops(lambda t: as_contiguous((t * 2).chunk(2, dim=1)[1]), x)
    rows = x.chunk(2, dim=0)[1]
    assert as_contiguous(rows) is rows
    assert as_contiguous(x.t()).is_contiguous()


class _ScaleThen(torch.autograd.Function):
    """y = finish(3 x), with the backward written out: 3 g (or g widened back for a chunk)."""

    @staticmethod
    def forward(ctx, x, finish):
        ctx.shape = x.shape
        return finish(x * 3)

    @staticmethod
    def backward(ctx, grad):
        if grad.shape != ctx.shape:  # the first half of the rows
            grad = torch.cat([grad, grad.new_zeros(ctx.shape[0] - grad.shape[0], *grad.shape[1:])])
        return grad * 3, None


@pytest.mark.parametrize(
    "finish",
    [lambda y: to_dtype(y, torch.float32), lambda y: as_contiguous(y.chunk(2, dim=0)[0])],
    ids=["same dtype", "contiguous rows"],
)
def test_a_compiled_function_returning_them_keeps_its_gradient(finish):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def loss(t):
        return (_ScaleThen.apply(t * 2, finish) * 5).square().sum()

    (eager,) = torch.autograd.grad(loss(x), x)
    torch._dynamo.reset()
    (compiled,) = torch.autograd.grad(torch.compile(loss, backend="eager")(x), x)
    assert eager.abs().sum() > 0
    torch.testing.assert_close(compiled, eager)
