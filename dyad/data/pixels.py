"""The datasets' images as tensors: what `MultimodalDataset.images` returns to the services.
Apart from the rest of `dyad.data` because it needs torch, which the router does not load.

Shape legend: N images, C channels, H height, W width."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from dyad.data.image_processor import ImageProcessor
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


def _rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`: transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _resized(image: Image.Image, processor: ImageProcessor) -> Image.Image:
    if processor.resize is not None:
        height, width = processor.resize
    elif processor.shortest_edge is not None:  # transformers' get_resize_output_image_size
        short, long = sorted((image.height, image.width))
        new_short, new_long = processor.shortest_edge, int(processor.shortest_edge * long / short)
        height, width = (new_long, new_short) if image.width <= image.height else (new_short, new_long)
    else:
        return image
    return image.resize((width, height), resample=processor.resample)


def _center_cropped(pixels_CHW: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """transformers' `center_crop`: zero-padded where the image is smaller than the crop."""
    height, width = size
    C, H, W = pixels_CHW.shape
    padded_CHW = np.zeros((C, max(H, height), max(W, width)), dtype=pixels_CHW.dtype)
    top_pad, left_pad = -(-(padded_CHW.shape[1] - H) // 2), -(-(padded_CHW.shape[2] - W) // 2)
    padded_CHW[:, top_pad : top_pad + H, left_pad : left_pad + W] = pixels_CHW
    top, left = (padded_CHW.shape[1] - height) // 2, (padded_CHW.shape[2] - width) // 2
    return padded_CHW[:, top : top + height, left : left + width]


def prepared_pixels(image: Image.Image, processor: ImageProcessor) -> np.ndarray:
    """One image as the checkpoint's image processor prepares it (`dyad/data/image_processor.py`):
    float32 [C, H, W]."""
    if processor.convert_rgb:
        image = _rgb(image)
    pixels = np.asarray(_resized(image, processor))
    pixels_CHW = pixels[None] if pixels.ndim == 2 else np.moveaxis(pixels, -1, 0)
    if processor.crop is not None:
        pixels_CHW = _center_cropped(pixels_CHW, processor.crop)
    if processor.rescale_factor is not None:
        pixels_CHW = (pixels_CHW.astype(np.float64) * processor.rescale_factor).astype(np.float32)
    if processor.mean is not None:
        pixels_CHW = pixels_CHW.astype(np.float32) if pixels_CHW.dtype.kind != "f" else pixels_CHW
        mean_C11 = np.array(processor.mean, dtype=pixels_CHW.dtype)[:, None, None]
        std_C11 = np.array(processor.std, dtype=pixels_CHW.dtype)[:, None, None]
        pixels_CHW = (pixels_CHW - mean_C11) / std_C11
    return pixels_CHW.astype(np.float32)


def prepared(paths: Sequence[Path], processor: ImageProcessor, device: torch.device | str | None) -> torch.Tensor:
    """Image files as `processor` prepares them: [len(paths), C, H, W] on `device`."""
    assert processor.output_size is not None, processor
    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(torch.from_numpy(prepared_pixels(image, processor)))
    if not images:
        return to_device(torch.zeros(0, 3, *processor.output_size), device)
    return to_device(torch.stack(images), device)
