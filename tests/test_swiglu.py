"""The fused SwiGLU gate agrees with its plain-PyTorch reference, forward and backward."""

import pytest
import torch

from dyad.kernels import swiglu as swiglu_lib


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


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the fused SwiGLU kernels are not exercised"
)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_fused_swiglu_agrees_with_the_reference(dtype):
    assert swiglu_lib._kernels() is not None, "Triton missing: the fused path would not run"
    torch.manual_seed(3)
    shape = (1031, 777)  # not a multiple of the block
    h1, h3, grad = (torch.randn(3, *shape, device="cuda") * 4).to(dtype).unbind(0)
    h1[0, :5] = torch.tensor([0.0, -0.0, 80.0, -80.0, 1e-3])  # zero, saturated sigmoid, tiny
    fast = _forward_and_grads(swiglu_lib.swiglu, h1, h3, grad)
    reference = _forward_and_grads(swiglu_lib.swiglu_reference, h1, h3, grad)
    assert "FusedSwiGLU" in type(fast[3]).__name__, "the fused path did not run"
    for name, got, expected in zip(("forward", "grad h1", "grad h3"), fast[:3], reference[:3]):
        if dtype == torch.bfloat16:  # rounded where eager rounds: equal but for exp's last bits
            torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-6, msg=name)
            equal = (got == expected).float().mean().item()
            assert equal > 0.999, f"{name}: only {equal:.4%} of elements bitwise equal"
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
