"""The encoder pool type: its config, its `dp × tp` layout, and its worker (`dyad.pools`)."""

from __future__ import annotations

import dataclasses

from dyad.encoder_service.config import EncoderConfig
from dyad.layout import EncoderLayout, validate_encoder_layout
from dyad.pools import PoolType


def _resolve(run, vocab_size: int | None) -> EncoderConfig:
    """Its rows are the LLM's input width, its images the dataset's."""
    encoder = dataclasses.replace(
        run.encoder, out_dim=run.llm.dim, image_size=run.data.image_size, channels=run.data.channels
    )
    validate_encoder_layout(run.parallel.encoder, encoder)
    return encoder


def _scale(run, replicas: int):
    layout = run.parallel.encoder
    if replicas % layout.tp:
        raise ValueError(f"replicas ({replicas}) must be a multiple of parallel.encoder.tp ({layout.tp})")
    layout = dataclasses.replace(layout, dp=replicas // layout.tp)
    return dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, encoder=layout))


POOL = PoolType(
    name="encoder",
    wire="POOL_ENCODER",
    config=EncoderConfig,
    layout=EncoderLayout,
    resolve=_resolve,
    scale=_scale,
    seed_offset=1,
    service="dyad.encoder_service.worker:EncoderWorker",
)
