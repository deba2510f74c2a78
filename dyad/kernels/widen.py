"""A bf16 gradient into a float32 one: `widened(src)` (a new float32 copy) and
`add_widened_(dst, src)` (dst += src in float32, in place), as the working weights hand their
gradients to their masters (dyad/working_weights.py).

PyTorch runs both through its casting elementwise path, which loads element by element: on an
H200 the copies and adds of a Qwen3-MoE-shaped step's gradients (2.8 B parameters, two
microbatches) reached about half of the device's bandwidth. The Triton kernels
(`dyad/kernels/widen_triton.py`) load and store whole blocks. The float32 results are PyTorch's bit
for bit: widening a bf16 value is exact, and the add rounds once either way. The kernels walk the
elements in memory order, so any dense layout works (an expert weight's gradient may come
transposed) as long as both tensors share it. The references (`widened_reference`,
`add_widened_reference_`) run off CUDA, without Triton, and on other layouts.
"""

from __future__ import annotations

import torch

from dyad.kernels.launch_sizes import cdiv
from dyad.kernels.triton_modules import triton_module

_BLOCK = 4096


def widened_reference(src: torch.Tensor) -> torch.Tensor:
    return src.to(torch.float32)


def add_widened_reference_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return dst.add_(src)


def widened(src: torch.Tensor) -> torch.Tensor:
    """`src` as a new float32 tensor of its shape and strides (as `Tensor.to` gives it)."""
    if not _fused_applies(src):
        return widened_reference(src)
    dst = torch.empty_like(src, dtype=torch.float32)
    _kernels().widen[(cdiv(src.numel(), _BLOCK),)](src, dst, src, src.numel(), ADD=False, BLOCK=_BLOCK)
    return dst


def add_widened_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst += src, dst float32, in place; returns dst."""
    if not (_fused_applies(src) and dst.dtype == torch.float32 and dst.device == src.device
            and dst.shape == src.shape and dst.stride() == src.stride()):
        return add_widened_reference_(dst, src)
    _kernels().widen[(cdiv(src.numel(), _BLOCK),)](src, dst, dst, src.numel(), ADD=True, BLOCK=_BLOCK)
    return dst


def _fused_applies(src: torch.Tensor) -> bool:
    return (
        src.is_cuda
        and src.dtype in (torch.bfloat16, torch.float16)
        and _dense(src)
        and src.numel() > 0
        and _kernels() is not None
    )


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill one block of memory without gaps or overlaps, in some order of its dims."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(order).is_contiguous()


def _kernels():
    return triton_module("widen_triton")
