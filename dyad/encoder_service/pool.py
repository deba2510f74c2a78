"""The encoder pool type: its config, its `dp × tp` layout, and its worker (`dyad.pools`)."""

from __future__ import annotations

import dataclasses

from dyad.data.image_tokens import FixedTokens
from dyad.data.samples import FILE_DATASETS
from dyad.encoder_service.config import EncoderConfig, Qwen3VLVisionConfig
from dyad.encoder_service.hf_config import image_processor, native_tower, pretrained
from dyad.layout import EncoderLayout, validate_encoder_layout
from dyad.pools import PoolType


def _resolve(run, vocab_size: int | None) -> EncoderConfig:
    """Its rows are the LLM's input width, its images the dataset's (a pretrained tower's
    architecture its own: `encoder.from_hf`); an image's rows must fit in
    one LLM sequence (refused here, before any worker allocates an image that large)."""
    native = native_tower(run.encoder, channels=run.data.channels)
    if native is not None:
        return _resolve_native(run, native)
    if run.llm.reads_deepstack:
        raise ValueError(f"llm.deepstack_levels ({run.llm.deepstack_levels}) needs DeepStack features from a "
                         "native-resolution tower (encoder.from_hf of a Qwen3-VL checkpoint); this encoder has none")
    encoder = run.encoder
    if encoder.from_hf:  # its architecture is the tower's
        encoder = pretrained(encoder, image_size=run.data.image_size, channels=run.data.channels)
    encoder = dataclasses.replace(
        encoder, out_dim=run.llm.dim, image_size=run.data.image_size, channels=run.data.channels
    )
    image_processor(encoder)  # its images are the size the tower's processor prepares
    if run.llm.multimodal_rope and FixedTokens(encoder.tokens_per_image).token_grid(0) is None:
        raise ValueError(f"llm.mrope_section ({list(run.llm.mrope_section)}) positions an image's tokens on their grid: "
                         f"the encoder's {encoder.tokens_per_image} tokens per image are not a square")
    if encoder.tokens_per_image > run.llm.max_seq_len:
        raise ValueError(
            f"data.image_size ({encoder.image_size}) gives {encoder.tokens_per_image} tokens per image "
            f"((data.image_size / encoder.patch_size / encoder.spatial_merge)**2), more than one LLM sequence "
            f"holds (llm.max_seq_len: {run.llm.max_seq_len})"
        )
    validate_encoder_layout(run.parallel.encoder, encoder)
    return encoder


def _resolve_native(run, native: Qwen3VLVisionConfig) -> EncoderConfig:
    """A native-resolution tower's merger writes the LLM's image rows (no projector of dyad's own
    between them), and it reads each image at its stored size: from files."""
    if native.out_dim != run.llm.dim:
        raise ValueError(f"llm.dim ({run.llm.dim}) must be the out_hidden_size of encoder.from_hf's tower "
                         f"({native.out_dim}): its merger writes the LLM's image rows")
    if run.llm.deepstack_levels not in (0, len(native.deepstack_layers)):
        raise ValueError(f"llm.deepstack_levels ({run.llm.deepstack_levels}) must be 0 or the number of encoder.from_hf's "
                         f"DeepStack mergers ({len(native.deepstack_layers)}): each level's rows come from one")
    if run.data.name not in FILE_DATASETS:
        raise ValueError(f"data.name ({run.data.name!r}) must be one of {FILE_DATASETS} with a native-resolution "
                         "tower (encoder.from_hf): it reads each image file at its own size")
    encoder = dataclasses.replace(run.encoder, native=native, out_dim=run.llm.dim, channels=run.data.channels)
    image_processor(encoder)  # the checkpoint's processor cuts the tower's patches
    validate_encoder_layout(run.parallel.encoder, native)
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
    freezable=("encoder", "vision_tower"),
    reads=("llm",),
)
