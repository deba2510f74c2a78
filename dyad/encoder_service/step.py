"""The encoder's part of a microbatch, shared by the worker and the single-process reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dyad.data import ImageProcessor


def encode_rows(model: nn.Module, dataset, image_ids: Sequence[int], device,
                processor: ImageProcessor | None = None) -> torch.Tensor:
    """Encoder output for `image_ids` as boundary rows [n_images * tokens_per_image, D],
    in the order the LLM splices them; `processor`: the tower's (`hf_config.image_processor`)."""
    images_NCHW = dataset.images(list(image_ids), device=device, processor=processor)
    return model(images_NCHW).flatten(0, 1)
