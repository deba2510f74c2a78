"""The fused SwiGLU gate agrees with its plain-PyTorch reference, forward and backward."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dyad.kernels import swiglu as swiglu_lib
from tests.helpers.experts import interleave_gate_up


def _forward_and_grads(fn, h1, h3, grad):
    h1, h3 = h1.clone().requires_grad_(), h3.clone().requires_grad_()
    out = fn(h1, h3)
    out.backward(grad)
    return out.detach(), h1.grad, h3.grad, out.grad_fn


def test_swiglu_off_cuda_is_the_reference():
    torch.manual_seed(0)
    h1, h3, grad = torch.randn(3, 37, 50).unbind(0)
    got = _forward_and_grads(swiglu_lib.swiglu, h1, h3, grad)
    expected = _forward_and_grads(swiglu_lib.swiglu_reference, h1, h3, grad)
    for a, b in zip(got[:3], expected[:3]):
        assert torch.equal(a, b)


def _pairs_forward_and_grad(fn, h13, grad):
    h13 = h13.clone().requires_grad_()
    out = fn(h13)
    out.backward(grad)
    return out.detach(), h13.grad, out.grad_fn


def test_swiglu_of_interleaved_pairs_is_swiglu_of_the_halves():
    torch.manual_seed(1)
    h1, h3, grad = torch.randn(3, 37, 50).unbind(0)
    out, grad_h13, _ = _pairs_forward_and_grad(swiglu_lib.swiglu_pairs, interleave_gate_up(h1, h3), grad)
    expected = _forward_and_grads(swiglu_lib.swiglu_reference, h1, h3, grad)
    # (not bitwise: CPU's silu takes another code path for strided operands)
    torch.testing.assert_close(out, expected[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_h13, interleave_gate_up(expected[1], expected[2]), rtol=1e-6, atol=1e-7)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the fused SwiGLU kernels are not exercised"
)


def _exact(h1, h3, grad):
    """Forward and both input gradients in float64: every one a product of a few factors."""
    x, h3, grad = h1.double(), h3.double(), grad.double()
    sigmoid = torch.sigmoid(x)
    silu = x * sigmoid
    return silu * h3, grad * h3 * sigmoid * (1 + x * (1 - sigmoid)), grad * silu


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_swiglu_rounds_as_eager_pytorch_does(dtype):
    """Each output is a product rounded twice to the dtype (an intermediate, then the result),
    as eager PyTorch rounds it: within 2 * (eps / 2) of the exact value, relatively; the
    reference is held to the same bound, and almost every element is bitwise the reference's."""
    assert swiglu_lib._kernels() is not None, "Triton missing: the fused path would not run"
    torch.manual_seed(3)
    shape = (1031, 777)  # not a multiple of the block
    h1, h3, grad = (torch.randn(3, *shape, device="cuda") * 4).to(dtype).unbind(0)
    h1[0, :5] = torch.tensor([0.0, -0.0, 30.0, -30.0, 1e-3])  # zero, saturated sigmoid, tiny
    fast = _forward_and_grads(swiglu_lib.swiglu, h1, h3, grad)
    reference = _forward_and_grads(swiglu_lib.swiglu_reference, h1, h3, grad)
    assert "FusedSwiGLU" in type(fast[3]).__name__, "the fused path did not run"
    eps = torch.finfo(dtype).eps
    for name, got, expected, exact in zip(("forward", "grad h1", "grad h3"), fast[:3], reference[:3], _exact(h1, h3, grad)):
        bound = 1.01 * eps * exact.abs() + 1e-6  # 1.01: float32's own error in the sigmoid
        for who, value in (("fused", got), ("reference", expected)):
            excess = ((value.double() - exact).abs() - bound).max().item()
            assert excess <= 0, f"{name}, {who}: {excess:g} beyond two roundings"
        equal = (got == expected).float().mean().item()
        assert equal > 0.99, f"{name}: only {equal:.4%} of elements bitwise equal"


@needs_cuda
def test_cuda_float32_takes_the_reference():
    h1 = torch.randn(4, 8, device="cuda", requires_grad=True)
    assert "FusedSwiGLU" not in type(swiglu_lib.swiglu(h1, h1.detach()).grad_fn).__name__


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_swiglu_of_pairs_is_the_fused_swiglu_of_the_halves(dtype):
    """The pair kernels (each pair loaded contiguously, split in registers) share the two-tensor
    kernels' math: bitwise their results."""
    torch.manual_seed(4)
    h1, h3, grad = (torch.randn(3, 1031, 777, device="cuda") * 4).to(dtype).unbind(0)
    pairs = _pairs_forward_and_grad(swiglu_lib.swiglu_pairs, interleave_gate_up(h1, h3), grad)
    halves = _forward_and_grads(swiglu_lib.swiglu, h1, h3, grad)
    assert "FusedSwiGLUPairs" in type(pairs[2]).__name__, "the fused path did not run"
    assert torch.equal(pairs[0], halves[0])
    assert torch.equal(pairs[1], interleave_gate_up(halves[1], halves[2]))


def test_the_pair_ops_shapes_as_a_compiled_graph_sees_them():
    with FakeTensorMode():
        h13 = torch.empty(6, 5, 8, dtype=torch.bfloat16)
        out = torch.ops.dyad.swiglu_pairs(h13)
        assert (tuple(out.shape), out.dtype) == ((6, 5, 4), torch.bfloat16)
        assert tuple(torch.ops.dyad.swiglu_pairs_backward(out, h13).shape) == (6, 5, 8)


@needs_cuda
def test_cuda_compiled_swiglu_of_pairs_runs_the_pair_kernels(monkeypatch):
    """Traced by torch.compile, the pairs' gate and its backward call the pair kernels (as custom
    ops): bitwise eager's fused results."""
    calls = []
    for name in ("_pairs_forward", "_pairs_backward"):
        kernel = getattr(swiglu_lib, name)
        monkeypatch.setattr(swiglu_lib, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    torch.manual_seed(6)
    h13 = (torch.randn(1031, 2 * 777, device="cuda") * 4).to(torch.bfloat16)
    grad = torch.randn(1031, 777, device="cuda").to(torch.bfloat16)
    eager = _pairs_forward_and_grad(swiglu_lib.swiglu_pairs, h13, grad)
    calls.clear()
    compiled = _pairs_forward_and_grad(torch.compile(swiglu_lib.swiglu_pairs, fullgraph=True), h13, grad)
    assert sorted(calls) == ["_pairs_backward", "_pairs_forward"]
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
