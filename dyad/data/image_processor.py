"""How a vision checkpoint's image processor prepares images, read from its
`preprocessor_config.json` (torch-free; `dyad/data/pixels.py` applies it).

Fixed-resolution processors of SigLIP (`size` {height, width}) and CLIP (`size` {shortest_edge},
then a center crop to `crop_size`), as transformers' PIL backends (`SiglipImageProcessorPil`,
`CLIPImageProcessorPil`) run them: convert to RGB (transparency composited onto white), resize with
Pillow's `resample` filter, center crop, multiply by `rescale_factor` (in float64, then float32),
normalize with `image_mean` / `image_std` (float32). Each step honours its `do_*` switch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FILE = "preprocessor_config.json"
PROCESSORS = ("SiglipImageProcessor", "SiglipImageProcessorFast", "SiglipImageProcessorPil",
              "CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")


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

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every prepared image; None where it depends on the image."""
        return self.crop or self.resize


def read_image_processor(directory: str | Path, field: str = "encoder.from_hf") -> ImageProcessor | None:
    """The processor `directory/preprocessor_config.json` describes; None without that file."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        return _processor(config)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{field}: {path} is not a SigLIP or CLIP image processor dyad reads: {e}") from None


def _processor(config: dict) -> ImageProcessor:
    kind = config.get("image_processor_type", "SiglipImageProcessor")
    if kind not in PROCESSORS:
        raise ValueError(f"image_processor_type {kind!r} (dyad reads {', '.join(PROCESSORS)})")
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
    mean_std = None
    if config.get("do_normalize", True):
        default_mean, default_std = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)) \
            if clip else ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
        mean_std = (_three(config.get("image_mean", default_mean)), _three(config.get("image_std", default_std)))
    return ImageProcessor(
        resize=resize,
        shortest_edge=shortest_edge,
        crop=crop,
        resample=int(config.get("resample", 3)),  # BICUBIC, both families' default
        rescale_factor=float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None,
        mean=mean_std[0] if mean_std else None,
        std=mean_std[1] if mean_std else None,
        convert_rgb=bool(config.get("do_convert_rgb", True)),
    )


def _three(value) -> tuple[float, ...]:
    values = (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"{len(values)} channel values, not 3")
    return values
