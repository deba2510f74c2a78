"""How many LLM tokens each image gives, by its id in the dataset's image table (torch-free): the
one home of that count for everything that plans or builds sequences (`dyad/data/samples.py`
expands each `<image>` placeholder into its image's tokens).

A fixed-resolution tower gives every image the same count (`FixedTokens`); a native-resolution
one (Qwen2-VL's processor, Qwen3-VL's tower) each image its own, from the image's stored size
(`NativeTokens`: the processor's patches of the resized image, after the merger). Which of them a
run has is the encoder's to say (`dyad.encoder_service.hf_config.image_tokens`); the router plans
with it, and a step command carries each image's count to the workers (`EncoderWork.image_tokens`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dyad.data.image_processor import PatchGrid

Grid = tuple[int, int, int]  # (frames, rows, columns) of an image's LLM tokens


class ImageTokens(Protocol):
    """By image table id: the LLM tokens of that image, and their grid where the tower lays them
    out as one (what multimodal rotary positions are computed from)."""

    def __call__(self, image_id: int) -> int: ...

    def token_grid(self, image_id: int) -> Grid | None: ...


@dataclass(frozen=True)
class FixedTokens:
    tokens: int

    def __call__(self, image_id: int) -> int:
        return self.tokens

    def token_grid(self, image_id: int) -> Grid | None:
        """A fixed-resolution tower's tokens are its square of patches, row-major (None: they
        are not a square)."""
        side = math.isqrt(self.tokens)
        return (1, side, side) if side * side == self.tokens else None


@dataclass(frozen=True)
class NativeTokens:
    grid: PatchGrid
    image_hw: Callable[[int], tuple[int, int]]  # the image's stored (height, width)

    def __call__(self, image_id: int) -> int:
        return self.grid.image_tokens(*self.image_hw(image_id))

    def token_grid(self, image_id: int) -> Grid:
        """The image's patch grid after the merger: its tokens, row-major."""
        t, h, w = self.grid.grid_thw(*self.image_hw(image_id))
        return t, h // self.grid.merge_size, w // self.grid.merge_size
