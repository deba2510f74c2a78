"""SwiGLU's gate, silu(h1) * h3, forward and backward each in one pass over its operands.

Legend: h1, h3 the two up-projections of the same rows (any shape, the same for both).

`swiglu_pairs` is the same gate over the (gate, up) column pairs of one interleaved [..., 2F]
tensor (dyad/kernels/gated_experts.py), with the same math: its kernels load each pair as two adjacent
elements of one contiguous block and split it in registers (reading every second element
instead, with strided loads, left the gate well short of the two-tensor kernels' bandwidth).

Eager PyTorch runs the gate as five elementwise kernels (silu and the product forward; the
product's two gradients and silu's backward) and keeps silu(h1) for the backward besides h1 and
h3. On the Mixtral-like MoE layer (16,384 rows of 14,336) each of those tensors is 470 MB.
`swiglu` reads h1 and h3 once forward and writes the product; backward it reads the gradient,
h1 and h3 once and writes both input gradients, keeping only h1 and h3.

It computes in float32 and rounds to the operands' dtype exactly where eager PyTorch rounds
(silu's output, each product, silu's input gradient), so it agrees with `swiglu_reference`, the
plain-PyTorch expression, to the last bit but for Triton's exp (a few float32 ulps before the
rounding). The reference runs off CUDA, without Triton and in float32, so that float32 runs
(dyad's checks of the math) compute exactly what they computed before, eager or compiled; `swiglu`
also under torch.compile (inductor fuses the two tensors' gate on its own).

Under torch.compile `swiglu_pairs` runs its kernels as custom ops (`dyad::swiglu_pairs`,
`dyad::swiglu_pairs_backward`), which the compiler keeps whole: traced, the reference's strided
halves became an inductor backward that assembled the interleaved gradient from two strided
slices at about half the bandwidth of the pair kernels (the experts' gate of a compiled LLM
step of 32 experts, top-8, 16 layers on an H200: 14.0 ms backward, 6.5 ms forward).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from dyad.kernels.launch_sizes import cdiv
from dyad.kernels.triton_modules import triton_module

_BLOCK = 2048
_DTYPES = (torch.bfloat16, torch.float16)  # float32 runs verify the math: they take the reference
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


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
        n = h1.numel()
        _kernels().gate_forward[(cdiv(n, _BLOCK),)](h1, h3, out, n, BLOCK=_BLOCK)
        return out

    @staticmethod
    def backward(ctx, grad):
        h1, h3 = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h1, grad_h3 = torch.empty_like(h1), torch.empty_like(h3)
        n = h1.numel()
        _kernels().gate_backward[(cdiv(n, _BLOCK),)](grad, h1, h3, grad_h1, grad_h3, n, BLOCK=_BLOCK)
        return grad_h1, grad_h3


def swiglu_pairs_reference(h13: torch.Tensor) -> torch.Tensor:
    return swiglu_reference(h13[..., 0::2], h13[..., 1::2])


def swiglu_pairs(h13: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the (gate, up) column pairs of an interleaved [..., 2F] tensor: silu(h13[..., 0::2])
    * h13[..., 1::2], in one pass each way like `swiglu`; its gradient is one [..., 2F] tensor
    (autograd would assemble it from the two strided halves' gradients, a zero-filled tensor and
    two strided copies)."""
    if torch.compiler.is_compiling() and _pairs_op_applies(h13):
        return _swiglu_pairs_op(h13)
    if not (_fused_applies(h13, h13) and h13.shape[-1] % 2 == 0):
        return swiglu_pairs_reference(h13)
    return _FusedSwiGLUPairs.apply(h13)


def _pairs_op_applies(h13: torch.Tensor) -> bool:
    """Where the compiled graph calls the pair kernels (on what the custom op makes contiguous)."""
    return h13.is_cuda and h13.dtype in _DTYPES and h13.shape[-1] % 2 == 0 and _HAVE_TRITON


class _FusedSwiGLUPairs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h13):
        ctx.save_for_backward(h13)
        return _pairs_forward(h13)

    @staticmethod
    def backward(ctx, grad):
        (h13,) = ctx.saved_tensors
        return _pairs_backward(grad.contiguous(), h13)


def _pairs_forward(h13: torch.Tensor) -> torch.Tensor:
    """The pair kernel's launch on a contiguous h13."""
    out = h13.new_empty((*h13.shape[:-1], h13.shape[-1] // 2))
    n = out.numel()
    if n:
        _kernels().pairs_forward[(cdiv(n, _BLOCK),)](h13, out, n, BLOCK=_BLOCK)
    return out


def _pairs_backward(grad: torch.Tensor, h13: torch.Tensor) -> torch.Tensor:
    """The pair kernel's gradient of h13, from the output's contiguous gradient."""
    grad_h13 = torch.empty_like(h13)
    n = grad.numel()
    if n:
        _kernels().pairs_backward[(cdiv(n, _BLOCK),)](grad, h13, grad_h13, n, BLOCK=_BLOCK)
    return grad_h13


# What torch.compile calls: custom ops it keeps whole, the backward registered as the forward's
# autograd.
@torch.library.custom_op("dyad::swiglu_pairs", mutates_args=())
def _swiglu_pairs_op(h13: torch.Tensor) -> torch.Tensor:
    return _pairs_forward(h13.contiguous())


@_swiglu_pairs_op.register_fake
def _(h13):
    return h13.new_empty((*h13.shape[:-1], h13.shape[-1] // 2))


@torch.library.custom_op("dyad::swiglu_pairs_backward", mutates_args=())
def _swiglu_pairs_backward_op(grad: torch.Tensor, h13: torch.Tensor) -> torch.Tensor:
    return _pairs_backward(grad.contiguous(), h13.contiguous())


@_swiglu_pairs_backward_op.register_fake
def _(grad, h13):
    return torch.empty_like(h13, memory_format=torch.contiguous_format)


def _pairs_op_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _pairs_op_gradient(ctx, grad):
    (h13,) = ctx.saved_tensors
    return torch.ops.dyad.swiglu_pairs_backward(grad, h13)


_swiglu_pairs_op.register_autograd(_pairs_op_gradient, setup_context=_pairs_op_setup)


def _kernels():
    """The Triton kernels (`dyad/kernels/swiglu_triton.py`), or None without Triton (CPU-only installs)."""
    return triton_module("swiglu_triton")
