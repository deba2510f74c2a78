"""A float32 weight's low-precision copy made once per optimizer step, not once per use, with its
gradient added straight into the float32 `.grad`.

Under autocast, every use of a float32 weight casts it anew, and backward casts the
low-precision gradient to float32 before adding it to `.grad`: per microbatch, a pass over the
weight and two over its gradient. `cast_once(w, dtype)` keeps the copy beside the weight until
the weight changes (`dyad.kernels.weight_cache`) and, in backward, adds the low-precision
gradient to `w.grad` in one kernel. The values are the same as autocast's: the copy is the same
rounding, and adding a bfloat16 gradient to a float32 sum promotes it exactly as casting it
first does. Hooks registered on the weight's gradient accumulation do not run for these
contributions.

Reference: `w.to(dtype)` (autograd's ToCopy and AccumulateGrad).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from dyad.kernels.weight_cache import cached_per_version


class _CastOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.weight = w
        return low.view_as(low)

    @staticmethod
    def backward(ctx, grad_low: torch.Tensor):
        w = ctx.weight
        if w.grad is None:
            w.grad = grad_low.to(w.dtype, memory_format=torch.contiguous_format)
        else:
            w.grad.add_(grad_low)
        return None, None


def cast_once(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in `dtype`, cast once per version of w; differentiable into w.grad (see the module)."""
    if not applies(w, dtype):
        return w.to(dtype)
    low = cached_per_version(w, ("cast", dtype), lambda t: t.detach().to(dtype))
    if not (torch.is_grad_enabled() and w.requires_grad):
        return low
    return _CastOnce.apply(w, low)


def applies(w: torch.Tensor, dtype: torch.dtype) -> bool:
    """A float32 leaf (a parameter) narrowed to a floating dtype; not a DTensor."""
    return (
        w.dtype == torch.float32
        and dtype != w.dtype
        and dtype.is_floating_point
        and w.is_leaf
        and not isinstance(w, DTensor)
    )
