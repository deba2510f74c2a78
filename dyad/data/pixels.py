"""The datasets' images as tensors: what `MultimodalDataset.images` (one size) and
`ImageFilesDataset.patches` (native resolution) return to the services. Apart from the rest of
`dyad.data` because it needs torch, which the router does not load. An image file is a path or an
open binary file (the bytes of a tar shard's member or a table's cell): whatever Pillow opens.

Shape legend: N images, C channels, H height, W width, P patches (over all images), T
temporal_patch_size, p patch_size, m merge_size, gh gw patch rows and columns."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from dyad.data.image_processor import ImageProcessor, PatchGrid
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


ImageFile = Path | BinaryIO


def decoded(files: Sequence[ImageFile], size: int, channels: int, device: torch.device | str | None) -> torch.Tensor:
    """Image files decoded, converted to `channels` (1: grayscale, 3: RGB), bilinearly resized to
    size x size and scaled to [0, 1]: [len(files), channels, size, size] on `device`."""
    mode = "L" if channels == 1 else "RGB"
    images_NCHW = torch.empty(len(files), channels, size, size)
    for n, file in enumerate(files):
        with Image.open(file) as image:
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
    size = processor.resized(image.height, image.width)
    if size is None:
        return image
    height, width = size
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


def prepared(files: Sequence[ImageFile], processor: ImageProcessor, device: torch.device | str | None) -> torch.Tensor:
    """Image files as `processor` prepares them: [len(files), C, H, W] on `device`."""
    assert processor.output_size is not None, processor
    images = []
    for file in files:
        with Image.open(file) as image:
            images.append(torch.from_numpy(prepared_pixels(image, processor)))
    if not images:
        return to_device(torch.zeros(0, 3, *processor.output_size), device)
    return to_device(torch.stack(images), device)


def patchified(pixels_CHW: np.ndarray, grid: PatchGrid) -> np.ndarray:
    """A prepared image cut as transformers' Qwen2-VL processor cuts it: [gh * gw, C * T * p * p],
    rows in merge order (each m x m block of patches consecutive), the image repeated over T frames."""
    C, H, W = pixels_CHW.shape
    p, m, T = grid.patch_size, grid.merge_size, grid.temporal_patch_size
    gh, gw = H // p, W // p
    assert gh * p == H and gw * p == W and gh % m == 0 and gw % m == 0, (pixels_CHW.shape, grid)
    blocks = pixels_CHW.reshape(C, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], T, p, p))
    return np.ascontiguousarray(frames).reshape(gh * gw, C * T * p * p)


def patches(
    files: Sequence[ImageFile], processor: ImageProcessor, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image files at their native resolution, as a Qwen2-VL processor prepares them:
    (pixel_values [P, C * T * p * p] float32, image_grid_thw [len(files), 3] int64) on `device`."""
    grid = processor.patches
    assert grid is not None, processor
    rows, grids = [], []
    for file in files:
        with Image.open(file) as image:
            rows.append(torch.from_numpy(patchified(prepared_pixels(image, processor), grid)))
            grids.append(grid.grid_thw(image.height, image.width))
    width = 3 * grid.temporal_patch_size * grid.patch_size**2
    pixel_values_PD = torch.cat(rows) if rows else torch.zeros(0, width)
    grid_thw_N3 = torch.tensor(grids, dtype=torch.int64).reshape(len(grids), 3)
    return to_device(pixel_values_PD, device), to_device(grid_thw_N3, device)
