"""SwiGLU's gate, silu(h1) * h3, forward and backward each in one pass over its operands.

Legend: h1, h3 the two up-projections of the same rows (any shape, the same for both).

`swiglu_pairs` is the same gate over the (gate, up) column pairs of one interleaved [..., 2F]
tensor (kernels/gated_experts.py), with the same kernels reading every second element.

Eager PyTorch runs the gate as five elementwise kernels (silu and the product forward; the
product's two gradients and silu's backward) and keeps silu(h1) for the backward besides h1 and
h3. On the Mixtral-like MoE layer (16,384 rows of 14,336) each of those tensors is 470 MB.
`swiglu` reads h1 and h3 once forward and writes the product; backward it reads the gradient,
h1 and h3 once and writes both input gradients, keeping only h1 and h3.

It computes in float32 and rounds to the operands' dtype exactly where eager PyTorch rounds
(silu's output, each product, silu's input gradient), so it agrees with `swiglu_reference`, the
plain-PyTorch expression, to the last bit but for Triton's exp (a few float32 ulps before the
rounding). The reference runs off CUDA, without Triton, under torch.compile (inductor fuses it
on its own) and in float32, so that float32 runs (dyad's checks of the math) compute exactly what
they computed before, eager or compiled.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dyad.kernels.launch_sizes import cdiv

_BLOCK = 2048
_DTYPES = (torch.bfloat16, torch.float16)  # float32 runs verify the math: they take the reference


def swiglu_reference(h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
    return F.silu(h1) * h3


def swiglu(h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
    if not _fused_applies(h1, h3):
        return swiglu_reference(h1, h3)
    return _FusedSwiGLU.apply(h1, h3)


def _fused_applies(h1: torch.Tensor, h3: torch.Tensor) -> bool:
    return (
        h1.is_cuda
        and not torch.compiler.is_compiling()
        and h1.shape == h3.shape
        and h1.dtype == h3.dtype in _DTYPES
        and h1.device == h3.device
        and h1.is_contiguous()
        and h3.is_contiguous()
        and _kernels() is not None
    )


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h1, h3):
        ctx.save_for_backward(h1, h3)
        out = torch.empty_like(h1)
        forward_kernel, _ = _kernels()
        n = h1.numel()
        forward_kernel[(cdiv(n, _BLOCK),)](h1, h3, out, n, STRIDE=1, BLOCK=_BLOCK)
        return out

    @staticmethod
    def backward(ctx, grad):
        h1, h3 = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h1, grad_h3 = torch.empty_like(h1), torch.empty_like(h3)
        _, backward_kernel = _kernels()
        n = h1.numel()
        backward_kernel[(cdiv(n, _BLOCK),)](grad, h1, h3, grad_h1, grad_h3, n, STRIDE=1, BLOCK=_BLOCK)
        return grad_h1, grad_h3


def swiglu_pairs_reference(h13: torch.Tensor) -> torch.Tensor:
    return swiglu_reference(h13[..., 0::2], h13[..., 1::2])


def swiglu_pairs(h13: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the (gate, up) column pairs of an interleaved [..., 2F] tensor: silu(h13[..., 0::2])
    * h13[..., 1::2], in one pass each way like `swiglu`; its gradient is one [..., 2F] tensor
    (autograd would assemble it from the two strided halves' gradients, a zero-filled tensor and
    two strided copies)."""
    if not (_fused_applies(h13, h13) and h13.shape[-1] % 2 == 0):
        return swiglu_pairs_reference(h13)
    return _FusedSwiGLUPairs.apply(h13)


def _second_of_pairs(h13: torch.Tensor) -> torch.Tensor:
    return h13.view(-1)[1:]  # the kernels read element 2i + 1 through it


class _FusedSwiGLUPairs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h13):
        ctx.save_for_backward(h13)
        out = h13.new_empty((*h13.shape[:-1], h13.shape[-1] // 2))
        forward_kernel, _ = _kernels()
        n = out.numel()
        forward_kernel[(cdiv(n, _BLOCK),)](h13, _second_of_pairs(h13), out, n, STRIDE=2, BLOCK=_BLOCK)
        return out

    @staticmethod
    def backward(ctx, grad):
        (h13,) = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h13 = torch.empty_like(h13)
        _, backward_kernel = _kernels()
        n = grad.numel()
        backward_kernel[(cdiv(n, _BLOCK),)](
            grad, h13, _second_of_pairs(h13), grad_h13, _second_of_pairs(grad_h13), n, STRIDE=2, BLOCK=_BLOCK
        )
        return grad_h13


@functools.cache
def _kernels():
    """(forward, backward) Triton kernels, or None where Triton is missing (CPU-only installs)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gate_forward(h1_ptr, h3_ptr, out_ptr, n, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < n
        h1 = tl.load(h1_ptr + at * STRIDE, mask=inside, other=0.0)
        h3 = tl.load(h3_ptr + at * STRIDE, mask=inside, other=0.0)
        x = h1.to(tl.float32)
        silu = (x / (1.0 + tl.exp(-x))).to(h1.dtype)  # rounded, as eager's silu output is
        out = silu.to(tl.float32) * h3.to(tl.float32)
        tl.store(out_ptr + at, out.to(h1.dtype), mask=inside)

    @triton.jit
    def gate_backward(
        grad_ptr, h1_ptr, h3_ptr, grad_h1_ptr, grad_h3_ptr, n, STRIDE: tl.constexpr, BLOCK: tl.constexpr
    ):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < n
        grad = tl.load(grad_ptr + at, mask=inside, other=0.0).to(tl.float32)
        h1 = tl.load(h1_ptr + at * STRIDE, mask=inside, other=0.0)
        h3 = tl.load(h3_ptr + at * STRIDE, mask=inside, other=0.0)
        x = h1.to(tl.float32)
        one_plus_exp = 1.0 + tl.exp(-x)
        sigmoid = 1.0 / one_plus_exp
        silu = (x / one_plus_exp).to(h1.dtype).to(tl.float32)  # as the forward rounds it
        grad_h3 = grad * silu
        grad_silu = (grad * h3.to(tl.float32)).to(h1.dtype).to(tl.float32)
        grad_h1 = grad_silu * sigmoid * (1.0 + x * (1.0 - sigmoid))  # silu's derivative, as eager's
        tl.store(grad_h1_ptr + at * STRIDE, grad_h1.to(h1.dtype), mask=inside)
        tl.store(grad_h3_ptr + at * STRIDE, grad_h3.to(h1.dtype), mask=inside)

    return gate_forward, gate_backward
