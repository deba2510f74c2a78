"""How a vision checkpoint's image processor prepares images, read from its
`preprocessor_config.json` (torch-free; `dyad/data/pixels.py` applies it).

Fixed-resolution processors of SigLIP (`size` {height, width}) and CLIP (`size` {shortest_edge},
then a center crop to `crop_size`), as transformers' PIL backends (`SiglipImageProcessorPil`,
`CLIPImageProcessorPil`) run them: convert to RGB (transparency composited onto white), resize with
Pillow's `resample` filter, center crop, multiply by `rescale_factor` (in float64, then float32),
normalize with `image_mean` / `image_std` (float32). Each step honours its `do_*` switch.

Native-resolution processors of Qwen2-VL, which Qwen2.5-VL and Qwen3-VL(-MoE) use too
(`Qwen2VLImageProcessor`, named `...Fast` in their checkpoints): each image keeps its aspect ratio,
resized (`smart_resize`) to sides that are multiples of patch_size * merge_size with an area within
[min_pixels, max_pixels] (`size` {shortest_edge, longest_edge}, or an older config's top-level
`min_pixels` / `max_pixels`); then RGB, rescale and normalize as above, and the image is cut into
patches: `pixel_values` [grid_h * grid_w, C * temporal_patch_size * patch_size²] (the image
repeated over temporal_patch_size frames), rows in merge order (each merge_size × merge_size block
of patches consecutive), and `image_grid_thw` (1, grid_h, grid_w). This is what transformers'
PIL backend (`Qwen2VLImageProcessorPil`) gives, exactly; its torchvision backend, which
`AutoImageProcessor` picks where torchvision is installed, resizes with torch's antialiased bicubic
instead of Pillow's, and resized pixels differ (Pillow rounds to 8 bits between its horizontal and
vertical passes); the grids are the same, and so are the pixels of an image `smart_resize` keeps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

FILE = "preprocessor_config.json"
FIXED = ("SiglipImageProcessor", "CLIPImageProcessor")
NATIVE = ("Qwen2VLImageProcessor",)
PROCESSORS = tuple(f"{name}{backend}" for name in FIXED + NATIVE for backend in ("", "Fast", "Pil"))
MAX_ASPECT_RATIO = 200  # smart_resize's


@dataclass(frozen=True)
class PatchGrid:
    """Qwen2-VL's native-resolution patches: how an image of any size is resized and cut."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `smart_resize`: (height, width), multiples of patch_size * merge_size with
        an area within [min_pixels, max_pixels], the aspect ratio kept as closely as they allow."""
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(f"an image of {height}x{width} pixels: its aspect ratio is over {MAX_ASPECT_RATIO}")
        factor = self.patch_size * self.merge_size
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """The image's `image_grid_thw` row: (frames, patch rows, patch columns)."""
        resized_height, resized_width = self.resized(height, width)
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    def image_tokens(self, height: int, width: int) -> int:
        """The LLM tokens of an image of this size: its patches after the merger."""
        t, h, w = self.grid_thw(height, width)
        return t * h * w // self.merge_size**2


@dataclass(frozen=True)
class ImageProcessor:
    resize: tuple[int, int] | None  # (height, width); None: resize the shortest edge to shortest_edge
    shortest_edge: int | None
    crop: tuple[int, int] | None  # (height, width) of the center crop; None: no crop
    resample: int  # a PIL.Image.Resampling value
    rescale_factor: float | None  # None: do_rescale off
    mean: tuple[float, ...] | None  # None: do_normalize off
    std: tuple[float, ...] | None
    convert_rgb: bool
    patches: PatchGrid | None = None  # native resolution (Qwen2-VL); None: one size for every image

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every prepared image; None where it depends on the image."""
        return None if self.patches else self.crop or self.resize

    def resized(self, height: int, width: int) -> tuple[int, int] | None:
        """The size an image of (height, width) is resized to; None: not resized."""
        if self.patches is not None:
            return self.patches.resized(height, width)
        if self.resize is not None:
            return self.resize
        if self.shortest_edge is None:
            return None
        short, long = sorted((height, width))  # transformers' get_resize_output_image_size
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)


def read_image_processor(directory: str | Path, field: str = "encoder.from_hf") -> ImageProcessor | None:
    """The processor `directory/preprocessor_config.json` describes; None without that file."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        return _processor(config)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{field}: {path} is not an image processor dyad reads: {e}") from None


def _processor(config: dict) -> ImageProcessor:
    kind = config.get("image_processor_type", "SiglipImageProcessor")
    if kind not in PROCESSORS:
        raise ValueError(f"image_processor_type {kind!r} (dyad reads {', '.join(PROCESSORS)})")
    if kind.startswith(NATIVE):
        return _native(config)
    clip = kind.startswith("CLIP")
    size = config.get("size", {"shortest_edge": 224} if clip else {"height": 224, "width": 224})
    if isinstance(size, int):  # an old config's single number: a square (SigLIP) or the shortest edge (CLIP)
        size = {"shortest_edge": size} if clip else {"height": size, "width": size}
    do_resize = config.get("do_resize", True)
    resize = (int(size["height"]), int(size["width"])) if do_resize and "height" in size else None
    shortest_edge = int(size["shortest_edge"]) if do_resize and resize is None else None
    crop = None
    if config.get("do_center_crop", clip):
        crop_size = config.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop_size, int):
            crop_size = {"height": crop_size, "width": crop_size}
        crop = (int(crop_size["height"]), int(crop_size["width"]))
    if crop is None and resize is None:
        raise ValueError("without a center crop, only a resize to {height, width} gives images of one size")
    return ImageProcessor(resize=resize, shortest_edge=shortest_edge, crop=crop, **_common(config, clip_mean_std=clip))


def _native(config: dict) -> ImageProcessor:
    """Qwen2-VL's: top-level min_pixels / max_pixels override `size`, as its __init__ does."""
    if not config.get("do_resize", True):
        raise ValueError("do_resize false: dyad reads native-resolution processors that resize (smart_resize)")
    size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280, **(config.get("size") or {})}
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if config.get(key) is not None:
            size[edge] = config[key]
    min_pixels, max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
    grid = PatchGrid(patch_size=int(config.get("patch_size", 14)),
                     temporal_patch_size=int(config.get("temporal_patch_size", 2)),
                     merge_size=int(config.get("merge_size", 2)), min_pixels=min_pixels, max_pixels=max_pixels)
    if min(grid.patch_size, grid.temporal_patch_size, grid.merge_size, min_pixels) < 1 or max_pixels < min_pixels:
        raise ValueError(f"sizes must be positive with min_pixels <= max_pixels, got {grid}")
    return ImageProcessor(resize=None, shortest_edge=None, crop=None, patches=grid,
                          **_common(config, clip_mean_std=True))


def _common(config: dict, clip_mean_std: bool) -> dict:
    """The steps both kinds share: resample filter, rescale, normalize, RGB."""
    mean_std = None
    if config.get("do_normalize", True):
        default_mean, default_std = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)) \
            if clip_mean_std else ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
        mean_std = (_three(config.get("image_mean", default_mean)), _three(config.get("image_std", default_std)))
    return {
        "resample": int(config.get("resample", 3)),  # BICUBIC, every family's default
        "rescale_factor": float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None,
        "mean": mean_std[0] if mean_std else None,
        "std": mean_std[1] if mean_std else None,
        "convert_rgb": bool(config.get("do_convert_rgb", True)),
    }


def _three(value) -> tuple[float, ...]:
    values = (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"{len(values)} channel values, not 3")
    return values
