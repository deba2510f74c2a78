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

from collections.abc import Callable
from dataclasses import dataclass

from dyad.data.image_processor import PatchGrid

ImageTokens = Callable[[int], int]  # image table id -> the LLM tokens of that image


@dataclass(frozen=True)
class FixedTokens:
    tokens: int

    def __call__(self, image_id: int) -> int:
        return self.tokens


@dataclass(frozen=True)
class NativeTokens:
    grid: PatchGrid
    image_hw: Callable[[int], tuple[int, int]]  # the image's stored (height, width)

    def __call__(self, image_id: int) -> int:
        return self.grid.image_tokens(*self.image_hw(image_id))
