"""Copying a host tensor to a device without making the host wait for the device.

`tensor.to("cuda")` from ordinary (pageable) host memory waits for every kernel already queued
on the current stream before it copies (torch's blocking copy synchronizes the stream). A worker
that prepares its next microbatch while the GPU still runs the previous one's backward pass would
stall there, and then feed the GPU only as fast as it launches. Copying from page-locked memory
with `non_blocking=True` queues the copy behind those kernels instead; torch's pinned-memory cache
keeps the staging block until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """`tensor` on `device` (None: unchanged), queued on the current stream without a host sync
    when it goes from host memory to a CUDA device."""
    if device is None:
        return tensor
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
