"""The datasets' images as tensors: what `MultimodalDataset.images` returns to the services.
Apart from the rest of `dyad.data` because it needs torch, which the router does not load."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from dyad.kernels.host_to_device import to_device


def upsampled(images_N1hw: np.ndarray, size: int, channels: int, device: torch.device | str | None) -> torch.Tensor:
    """Single-channel float32 images in [0, 1], bilinearly resized to size x size on `device`
    and repeated over `channels`: [N, channels, size, size]."""
    if len(images_N1hw) == 0:
        return torch.zeros(0, channels, size, size, device=device)
    images = to_device(torch.from_numpy(images_N1hw), device)
    if images.shape[-1] != size:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)
    return images.expand(-1, channels, -1, -1).contiguous()


def decoded(paths: Sequence[Path], size: int, channels: int, device: torch.device | str | None) -> torch.Tensor:
    """Image files decoded, converted to `channels` (1: grayscale, 3: RGB), bilinearly resized to
    size x size and scaled to [0, 1]: [len(paths), channels, size, size] on `device`."""
    mode = "L" if channels == 1 else "RGB"
    images_NCHW = torch.empty(len(paths), channels, size, size)
    for n, path in enumerate(paths):
        with Image.open(path) as image:
            resized = image.convert(mode).resize((size, size), Image.Resampling.BILINEAR)
        pixels_HWC = np.asarray(resized, dtype=np.float32).reshape(size, size, channels)
        images_NCHW[n] = torch.from_numpy(pixels_HWC).permute(2, 0, 1) / 255.0
    return to_device(images_NCHW, device)
