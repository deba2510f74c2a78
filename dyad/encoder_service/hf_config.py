"""What a Hugging Face vision tower's config says, as dyad's encoder config (torch-free).

Families: SigLIP (`siglip_vision_model`, or the vision half of a `siglip` model: a patch
embedding with a bias, tanh GELU) and CLIP (`clip_vision_model` / `clip`: a class token, a
LayerNorm before the first block, quick GELU, no patch bias), both with biases on q, k and v. A
tower feeds the LLM as LLaVA's does: the features of `feature_layer` (-1: the last block's
output, -2: the one before), before the final norm, without the class token; loaded alone
(`dyad.hf.load`) it is transformers' `last_hidden_state`. A LLaVA directory's tower comes with its
projector (two linears around an exact GELU, dyad's own projector at `encoder.spatial_merge` 1), and
with the feature layer its config names.

Qwen3-VL (`qwen3_vl_vision_config`): the native-resolution tower of a Qwen3-VL or Qwen3-VL-MoE
model (its `vision_config`) or saved alone, dyad's `Qwen3VLVisionConfig`; in a run, the encoder's
`native` tower (`native_tower`), its images prepared by the checkpoint's Qwen2-VL processor, each
giving its own number of tokens (`image_tokens`).
"""

from __future__ import annotations

import dataclasses

from dyad.data.image_processor import ImageProcessor, read_image_processor
from dyad.data.image_tokens import FixedTokens, ImageTokens, NativeTokens
from dyad.encoder_service.config import EncoderConfig, Qwen3VLVisionConfig
from dyad.hf_checkpoint import QWEN3_VL_DEEPSTACK_INDEXES, adopted, read_config

FAMILIES = {"siglip_vision_model": "siglip", "clip_vision_model": "clip", "siglip": "siglip", "clip": "clip"}
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "quick_gelu": "quick_gelu", "gelu": "gelu"}


def vision_config(hf: dict) -> dict:
    """The vision tower's part of a config.json: itself, or its `vision_config`."""
    return hf["vision_config"] if hf.get("model_type") in ("siglip", "clip", "llava") else hf


def llava_feature_layer(hf: dict) -> int | None:
    """The feature layer a LLaVA's config.json names (None for a tower alone), or a ValueError
    naming the field of one whose projector or feature selection dyad's encoder does not model."""
    if hf.get("model_type") != "llava":
        return None
    family = FAMILIES.get(hf["vision_config"].get("model_type"))
    # LLaVA's "default" drops the first token, "full" keeps them all: dyad drops a class token only
    strategy = "default" if family == "clip" else "full"
    checks = (
        ("projector_hidden_act", hf.get("projector_hidden_act", "gelu"), "gelu"),
        ("multimodal_projector_bias", hf.get("multimodal_projector_bias", True), True),
        ("vision_feature_select_strategy", hf.get("vision_feature_select_strategy", "default"), strategy),
    )
    for field, value, supported in checks:
        if value != supported:
            raise ValueError(f"config.json {field}={value!r} is not supported for a LLaVA of a {family} tower "
                             f"(dyad's: {supported!r})")
    layer = hf.get("vision_feature_layer", -2)
    several = not isinstance(layer, int)  # a list: several layers' features concatenated
    if several:
        raise ValueError(f"config.json vision_feature_layer={layer!r}: dyad takes the features of one layer")
    return layer


def encoder_config(hf: dict, *, feature_layer: int | None = None, out_dim: int = 1) -> EncoderConfig:
    """dyad's encoder for the tower of `hf` (a config.json); `feature_layer` None: the whole
    tower as transformers' `last_hidden_state` has it (SigLIP's after its final norm; CLIP's
before, its class token first)."""
    vision = vision_config(hf)
    family = FAMILIES.get(vision.get("model_type"))
    if family is None:
        native = " (SigLIP2's native-resolution towers; its fixed-resolution checkpoints are 'siglip')" \
            if vision.get("model_type", "").startswith("siglip2") else ""
        raise ValueError(f"config.json vision model_type {vision.get('model_type')!r} is not one dyad loads{native} "
                         f"({', '.join(sorted(FAMILIES))})")
    act = vision.get("hidden_act", "gelu_pytorch_tanh" if family == "siglip" else "quick_gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.json vision hidden_act {act!r} is not supported")
    layers = vision["num_hidden_layers"]
    if feature_layer is not None and not -layers <= feature_layer <= -1:
        raise ValueError(f"encoder.feature_layer ({feature_layer}) must be in [-{layers}, -1] for a tower of {layers} blocks")
    return EncoderConfig(
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        channels=vision.get("num_channels", 3),
        dim=vision["hidden_size"],
        depth=layers if feature_layer is None else layers + 1 + feature_layer,
        heads=vision["num_attention_heads"],
        mlp_hidden=vision["intermediate_size"],
        out_dim=out_dim,
        norm_eps=vision.get("layer_norm_eps", 1e-6 if family == "siglip" else 1e-5),
        activation=_ACTIVATIONS[act],
        qkv_bias=True,
        patch_bias=family == "siglip",
        cls_token=family == "clip",
        pre_norm=family == "clip",
        final_norm=feature_layer is None and family == "siglip",
    )


# What a tower fixes: a run's encoder section may repeat these, never contradict them.
ARCHITECTURE = ("patch_size", "dim", "depth", "heads", "mlp_hidden", "norm_eps", "activation", "qkv_bias",
                "patch_bias", "cls_token", "pre_norm", "final_norm")


def pretrained(encoder: EncoderConfig, *, image_size: int, channels: int) -> EncoderConfig:
    """`encoder` with the architecture of its `from_hf` tower at `encoder.feature_layer`; the
    data's images must be the tower's size and channels; a field the run set away from its
    default to something else than the tower's is a ValueError naming both."""
    hf = read_config(encoder.from_hf, "encoder.from_hf")
    try:
        named = llava_feature_layer(hf)
        if named is not None and named != encoder.feature_layer:
            raise ValueError(f"encoder.feature_layer ({encoder.feature_layer}) must be the LLaVA's vision_feature_layer "
                             f"({named}, encoder.from_hf)")
        derived = encoder_config(hf, feature_layer=encoder.feature_layer)
    except (KeyError, TypeError) as error:
        raise ValueError(f"encoder.from_hf: {encoder.from_hf}/config.json lacks or misstates {error}") from None
    for field, ours in (("image_size", image_size), ("channels", channels)):
        if ours != getattr(derived, field):
            raise ValueError(f"data.{field} ({ours}) must be the tower's ({getattr(derived, field)}, encoder.from_hf)")
    return dataclasses.replace(  # the images' size with the patches' (their sizes are checked together)
        encoder, **adopted(encoder, derived, ARCHITECTURE, section="encoder", source="encoder.from_hf's tower"),
        image_size=image_size, channels=channels,
    )


def image_processor(encoder: EncoderConfig) -> ImageProcessor | None:
    """How the `encoder.from_hf` checkpoint's image processor prepares images (its
    preprocessor_config.json), None without one (the dataset's own preparation); a ValueError
    where it prepares images of another size than the encoder's, or, for a native-resolution
    tower, where there is none or it cuts patches other than the tower's."""
    processor = read_image_processor(encoder.from_hf) if encoder.from_hf else None
    if encoder.native is not None:
        return _native_processor(encoder.from_hf, processor, encoder.native)
    if processor is not None and processor.patches is not None:
        raise ValueError(f"encoder.from_hf: {encoder.from_hf}'s preprocessor_config.json prepares images at their "
                         f"own size (a Qwen2-VL processor), its tower takes one size ({encoder.image_size})")
    if processor is not None and processor.output_size != (encoder.image_size, encoder.image_size):
        raise ValueError(f"data.image_size ({encoder.image_size}) must be the size encoder.from_hf's "
                         f"preprocessor_config.json prepares images at ({processor.output_size})")
    return processor


def _native_processor(directory: str, processor: ImageProcessor | None, tower: Qwen3VLVisionConfig) -> ImageProcessor:
    if processor is None or processor.patches is None:
        raise ValueError(f"encoder.from_hf: {directory} needs the preprocessor_config.json of a native-resolution "
                         f"processor (Qwen2VLImageProcessor): it says how each image is resized and cut into patches")
    grid = processor.patches
    for field, theirs, ours in (("patch_size", grid.patch_size, tower.patch_size),
                                ("temporal_patch_size", grid.temporal_patch_size, tower.temporal_patch),
                                ("merge_size", grid.merge_size, tower.spatial_merge)):
        if theirs != ours:
            raise ValueError(f"encoder.from_hf: preprocessor_config.json {field}={theirs} is not the tower's "
                             f"({ours}, config.json)")
    return processor


def image_tokens(encoder: EncoderConfig, dataset) -> ImageTokens:
    """How many LLM tokens each image of `dataset` gives the (resolved) encoder: a native tower
    each its own, its processor's for the image's stored size; else `encoder.tokens_per_image`."""
    if encoder.native is None:
        return FixedTokens(encoder.tokens_per_image)
    return NativeTokens(image_processor(encoder).patches, dataset.image_hw)


QWEN3_VL_VISION = ("qwen3_vl_moe_vision", "qwen3_vl_vision")  # a tower saved alone
QWEN3_VL = ("qwen3_vl_moe", "qwen3_vl")  # a whole model (and an older checkpoint's vision_config)


def qwen3_vl_vision(hf: dict) -> dict | None:
    """The Qwen3-VL vision config of a config.json (itself, or a whole model's `vision_config`),
    None for another model's."""
    if hf.get("model_type") in QWEN3_VL and "vision_config" in hf:
        return hf["vision_config"]
    return hf if hf.get("model_type") in QWEN3_VL_VISION + QWEN3_VL else None


def qwen3_vl_vision_config(hf: dict) -> Qwen3VLVisionConfig:
    """dyad's tower for a Qwen3-VL(-MoE) config.json (the whole model's or the tower's); a
    ValueError naming the field of one dyad does not model."""
    vision = qwen3_vl_vision(hf)
    if vision is None:
        raise ValueError(f"config.json model_type {hf.get('model_type')!r} is not a Qwen3-VL model or vision tower "
                         f"({', '.join(QWEN3_VL + QWEN3_VL_VISION)})")
    for field in ("patch_size", "temporal_patch_size"):
        if not isinstance(vision.get(field, 16), int):
            raise ValueError(f"config.json vision_config {field}={vision[field]!r}: dyad takes one int (square patches)")
    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.json vision_config hidden_act={act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    rope = dict(vision.get("rope_parameters") or {})
    if rope.pop("rope_type", "axial") != "axial" or set(rope) - {"rope_theta"}:
        raise ValueError(f"config.json vision_config rope_parameters={vision['rope_parameters']!r} is not supported "
                         f"(dyad's: rope_type 'axial' and a rope_theta)")
    positions = vision.get("num_position_embeddings", 2304)
    side = round(positions**0.5)
    if side * side != positions:
        raise ValueError(f"config.json vision_config num_position_embeddings={positions} must be a square "
                         f"(a side x side grid of positions)")
    depth, layers = vision.get("depth", 27), list(vision.get("deepstack_visual_indexes", QWEN3_VL_DEEPSTACK_INDEXES))
    if layers != sorted(set(layers)) or any(not 0 <= i < depth for i in layers):
        raise ValueError(f"config.json vision_config deepstack_visual_indexes={layers} must be increasing "
                         f"block indices in [0, {depth}) (depth: {depth})")
    return Qwen3VLVisionConfig(  # transformers' defaults where a config leaves a field out
        patch_size=vision.get("patch_size", 16),
        temporal_patch=vision.get("temporal_patch_size", 2),
        channels=vision.get("in_channels", 3),
        dim=vision.get("hidden_size", 1152),
        depth=depth,
        heads=vision.get("num_heads", 16),
        mlp_hidden=vision.get("intermediate_size", 4304),
        activation=_ACTIVATIONS[act],
        position_grid=side,
        rope_theta=rope.get("rope_theta", 10000.0),
        spatial_merge=vision.get("spatial_merge_size", 2),
        out_dim=vision.get("out_hidden_size", 3584),
        deepstack_layers=tuple(layers),
    )


def native_tower(encoder: EncoderConfig, *, channels: int) -> Qwen3VLVisionConfig | None:
    """The native-resolution tower of `encoder.from_hf` (a Qwen3-VL(-MoE) model, or its tower
    alone); None for a fixed-resolution one. A ValueError where the run's `encoder.native`
    contradicts it, or the data's channels are not the tower's."""
    hf = read_config(encoder.from_hf, "encoder.from_hf") if encoder.from_hf else {}
    if qwen3_vl_vision(hf) is None:
        if encoder.native is not None:
            raise ValueError("encoder.native is resolved from encoder.from_hf (a Qwen3-VL model or vision tower), "
                             "never set by hand: leave it unset")
        return None
    try:
        derived = qwen3_vl_vision_config(hf)
    except (KeyError, TypeError) as error:
        raise ValueError(f"encoder.from_hf: {encoder.from_hf}/config.json lacks or misstates {error}") from None
    if encoder.native is not None and encoder.native != derived:
        raise ValueError(f"encoder.native={encoder.native!r} contradicts encoder.from_hf's tower ({derived!r}): "
                         "leave it unset")
    if channels != derived.channels:
        raise ValueError(f"data.channels ({channels}) must be the tower's ({derived.channels}, encoder.from_hf)")
    return derived
