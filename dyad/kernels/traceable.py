"""Casts and layout changes for what an autograd.Function's forward returns, skipped where they
would change nothing, so that torch.compile never sees them.

`t.to(t.dtype)`, `t.float()` on float32 and `t.contiguous()` on a contiguous tensor return `t`
itself. Returned from an autograd.Function's forward, such a result makes torch 2.11's dynamo
lose the function's backward: the compiled gradients through it are zeros, with every backend
("eager" included), and no error (torch 2.13 gets them right). The GPU hosts run torch 2.11, so
dyad's Functions pass what they return through these wherever the cast or copy may be a no-op.
"""

import torch


def to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def as_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()
