"""The encoder's part of a microbatch, shared by the worker and the single-process reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dyad.data import ImageProcessor


def encode_rows(model: nn.Module, dataset, image_ids: Sequence[int], device,
                processor: ImageProcessor | None = None, *, deepstack: bool = False) -> torch.Tensor:
    """Encoder output for `image_ids` as boundary rows [N, W]: each image's tokens, one image
    after another, in the order the LLM splices them; `processor`: the tower's
    (`hf_config.image_processor`). A native-resolution processor's images (`processor.patches`)
    go through the tower as one packed sequence, each at its own size; a row is its merged token
    [D], and with `deepstack` (the LLM's llm.deepstack_levels) each DeepStack level's after it
    (W = D * (1 + levels)): every boundary tensor of a token travels in its one row."""
    if processor is not None and processor.patches is not None:
        pixel_values_PX, grid_thw_N3 = dataset.patches(list(image_ids), processor, device)
        if deepstack:
            merged_ND, levels = model(pixel_values_PX, grid_thw_N3)
            return torch.cat([merged_ND, *levels], dim=1)
        return model.merged_tokens(pixel_values_PX, grid_thw_N3)
    images_NCHW = dataset.images(list(image_ids), device=device, processor=processor)
    return model(images_NCHW).flatten(0, 1)
