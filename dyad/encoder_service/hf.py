"""Hugging Face vision towers' weights under `VisionEncoder`'s names (`encoder_sources`: read a
rank's piece at a time; `encoder_state_dict`: whole), and Qwen3-VL's under `Qwen3VLVision`'s
(`qwen3_vl_sources`, `qwen3_vl_state_dict`); their config is `dyad.encoder_service.hf_config`'s.
A tower's tensors are found under whatever prefix its checkpoint gives them (a tower alone, a
SigLIP or CLIP model's `vision_model.`, a LLaVA's vision tower, a Qwen3-VL's `model.visual.`).
`tower_tensors` and `qwen3_vl_tower_tensors` are the inverses: dyad's tensors under the names."""

from __future__ import annotations

import torch

from dyad.encoder_service.config import EncoderConfig, Qwen3VLVisionConfig
from dyad.hf_checkpoint import HFCheckpoint
from dyad.slices import Concatenated, Merged, Source

_PATCH = "embeddings.patch_embedding.weight"
_QWEN3_VL_PATCH = "patch_embed.proj.weight"
_PROJECTOR = "multi_modal_projector.linear_1.weight"


def tower_prefix(checkpoint: HFCheckpoint, patch: str = _PATCH) -> str:
    """The prefix of the checkpoint's vision tower tensors, found by the name of its patch
    embedding `patch` (a ValueError unless exactly one)."""
    prefixes = sorted(name.removesuffix(patch) for name in checkpoint.names if name.endswith(patch))
    if len(prefixes) != 1:
        raise ValueError(f"{checkpoint.path}: expected one vision tower ('...{patch}'), found {len(prefixes)}")
    return prefixes[0]


def encoder_state_dict(checkpoint: HFCheckpoint, cfg: EncoderConfig, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The tower's part of `VisionEncoder(cfg)`'s state dict (not the projector), every tensor's
    name and shape checked; blocks past `cfg.depth` (a feature layer before the last) are not read."""
    return {name: source.full() for name, source in encoder_sources(checkpoint, cfg, prefix).items()}


def encoder_sources(checkpoint: HFCheckpoint, cfg: EncoderConfig, prefix: str | None = None) -> dict[str, Source]:
    """Where each tensor of the tower's part of `VisionEncoder(cfg)`'s state dict lies in
    `checkpoint` (nothing read yet), as `encoder_state_dict` reads them."""
    prefix = tower_prefix(checkpoint) if prefix is None else prefix
    D, C, p, M = cfg.dim, cfg.channels, cfg.patch_size, cfg.mlp_dim

    def get(name: str, *shape: int) -> Source:
        return checkpoint.stored(prefix + name, shape)

    state = {
        # [D, C, ph, pw] flattened to [D, C * ph * pw], as patchify flattens a patch
        "patch_embed.weight": Merged(Merged(get(_PATCH, D, C, p, p), 2), 1),
        "pos_embed_PD": get("embeddings.position_embedding.weight", cfg.positions, D),
    }
    if cfg.patch_bias:
        state["patch_embed.bias"] = get("embeddings.patch_embedding.bias", D)
    if cfg.cls_token:
        state["cls_token_D"] = get("embeddings.class_embedding", D)
    if cfg.pre_norm:
        state["pre_norm.weight"], state["pre_norm.bias"] = get("pre_layrnorm.weight", D), get("pre_layrnorm.bias", D)
    if cfg.final_norm:
        state["norm.weight"], state["norm.bias"] = get("post_layernorm.weight", D), get("post_layernorm.bias", D)
    for i in range(cfg.depth):
        hf, ours = f"encoder.layers.{i}", f"blocks.{i}"
        for mine, theirs in (("attn_norm", "layer_norm1"), ("mlp_norm", "layer_norm2")):
            state[f"{ours}.{mine}.weight"] = get(f"{hf}.{theirs}.weight", D)
            state[f"{ours}.{mine}.bias"] = get(f"{hf}.{theirs}.bias", D)
        # q, k, v blocks in that order: the fused projection's layout
        state[f"{ours}.qkv.weight"] = Concatenated([get(f"{hf}.self_attn.{x}_proj.weight", D, D) for x in "qkv"])
        state[f"{ours}.qkv.bias"] = Concatenated([get(f"{hf}.self_attn.{x}_proj.bias", D) for x in "qkv"])
        state[f"{ours}.proj.weight"] = get(f"{hf}.self_attn.out_proj.weight", D, D)
        state[f"{ours}.proj.bias"] = get(f"{hf}.self_attn.out_proj.bias", D)
        state[f"{ours}.fc1.weight"], state[f"{ours}.fc1.bias"] = get(f"{hf}.mlp.fc1.weight", M, D), get(f"{hf}.mlp.fc1.bias", M)
        state[f"{ours}.fc2.weight"], state[f"{ours}.fc2.bias"] = get(f"{hf}.mlp.fc2.weight", D, M), get(f"{hf}.mlp.fc2.bias", D)
    projectors = sorted(n.removesuffix("linear_1.weight") for n in checkpoint.names if n.endswith(_PROJECTOR))
    if projectors:  # a LLaVA's: its own, where a tower alone leaves dyad's drawn one
        O = cfg.out_dim
        for mine, theirs, shape in (("proj_in", "linear_1", (O, cfg.merged_dim)), ("proj_out", "linear_2", (O, O))):
            state[f"{mine}.weight"] = checkpoint.stored(f"{projectors[0]}{theirs}.weight", shape)
            state[f"{mine}.bias"] = checkpoint.stored(f"{projectors[0]}{theirs}.bias", shape[:1])
    return state


def tower_tensors(state: dict[str, torch.Tensor], cfg: EncoderConfig, prefix: str) -> dict[str, torch.Tensor]:
    """`VisionEncoder(cfg)`'s full state dict under a Hugging Face tower's names, each prefixed by
    `prefix`, and its projector as a LLaVA's (`multi_modal_projector.`): the inverse of
    `encoder_sources` for a LLaVA's checkpoint, each tensor contiguous (what safetensors writes)."""
    D, C, p = cfg.dim, cfg.channels, cfg.patch_size
    tensors = {
        _PATCH: state["patch_embed.weight"].reshape(D, C, p, p),
        "embeddings.position_embedding.weight": state["pos_embed_PD"],
    }
    if cfg.patch_bias:
        tensors["embeddings.patch_embedding.bias"] = state["patch_embed.bias"]
    if cfg.cls_token:
        tensors["embeddings.class_embedding"] = state["cls_token_D"]
    if cfg.pre_norm:
        tensors["pre_layrnorm.weight"], tensors["pre_layrnorm.bias"] = state["pre_norm.weight"], state["pre_norm.bias"]
    if cfg.final_norm:
        tensors["post_layernorm.weight"], tensors["post_layernorm.bias"] = state["norm.weight"], state["norm.bias"]
    for i in range(cfg.depth):
        hf, ours = f"encoder.layers.{i}", f"blocks.{i}"
        for mine, theirs in (("attn_norm", "layer_norm1"), ("mlp_norm", "layer_norm2"), ("proj", "self_attn.out_proj"),
                             ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
            for kind in ("weight", "bias"):
                tensors[f"{hf}.{theirs}.{kind}"] = state[f"{ours}.{mine}.{kind}"]
        for kind in ("weight", "bias"):
            for x, block in zip("qkv", state[f"{ours}.qkv.{kind}"].chunk(3), strict=True):
                tensors[f"{hf}.self_attn.{x}_proj.{kind}"] = block
    tensors = {prefix + name: tensor for name, tensor in tensors.items()}
    for mine, theirs in (("proj_in", "linear_1"), ("proj_out", "linear_2")):
        for kind in ("weight", "bias"):
            tensors[f"multi_modal_projector.{theirs}.{kind}"] = state[f"{mine}.{kind}"]
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def _qwen3_vl_names(cfg: Qwen3VLVisionConfig) -> dict[str, str]:
    """`Qwen3VLVision(cfg)`'s parameter names -> a Qwen3-VL tower's (unprefixed), but the patch
    embedding's (its Conv3d weight is 5-D)."""
    names = {"patch_embed.bias": "patch_embed.proj.bias", "pos_embed_GD": "pos_embed.weight"}
    for i in range(cfg.depth):
        for mine, theirs in (("attn_norm", "norm1"), ("mlp_norm", "norm2"), ("qkv", "attn.qkv"), ("proj", "attn.proj"),
                             ("fc1", "mlp.linear_fc1"), ("fc2", "mlp.linear_fc2")):
            names |= {f"blocks.{i}.{mine}.{kind}": f"blocks.{i}.{theirs}.{kind}" for kind in ("weight", "bias")}
    mergers = [("merger", "merger")] + [(f"deepstack_mergers.{j}", f"deepstack_merger_list.{j}")
                                        for j in range(len(cfg.deepstack_layers))]
    for mine, theirs in mergers:
        for part, hf_part in (("norm", "norm"), ("fc1", "linear_fc1"), ("fc2", "linear_fc2")):
            names |= {f"{mine}.{part}.{kind}": f"{theirs}.{hf_part}.{kind}" for kind in ("weight", "bias")}
    return names


def _qwen3_vl_shapes(cfg: Qwen3VLVisionConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in a Qwen3-VL tower (unprefixed names)."""
    D, M, E, O = cfg.dim, cfg.mlp_hidden, cfg.merged_dim, cfg.out_dim
    shapes = {_QWEN3_VL_PATCH: (D, cfg.channels, cfg.temporal_patch, cfg.patch_size, cfg.patch_size),
              "patch_embed.proj.bias": (D,), "pos_embed.weight": (cfg.position_grid**2, D)}
    for i in range(cfg.depth):
        hf = f"blocks.{i}"
        shapes |= {f"{hf}.{norm}.{kind}": (D,) for norm in ("norm1", "norm2") for kind in ("weight", "bias")}
        for name, out, into in (("attn.qkv", 3 * D, D), ("attn.proj", D, D), ("mlp.linear_fc1", M, D),
                                ("mlp.linear_fc2", D, M)):
            shapes[f"{hf}.{name}.weight"], shapes[f"{hf}.{name}.bias"] = (out, into), (out,)
    for hf, norm in [("merger", D)] + [(f"deepstack_merger_list.{j}", E) for j in range(len(cfg.deepstack_layers))]:
        shapes[f"{hf}.norm.weight"] = shapes[f"{hf}.norm.bias"] = (norm,)
        shapes[f"{hf}.linear_fc1.weight"], shapes[f"{hf}.linear_fc1.bias"] = (E, E), (E,)
        shapes[f"{hf}.linear_fc2.weight"], shapes[f"{hf}.linear_fc2.bias"] = (O, E), (O,)
    return shapes


def qwen3_vl_sources(checkpoint: HFCheckpoint, cfg: Qwen3VLVisionConfig, prefix: str | None = None) -> dict[str, Source]:
    """Where each tensor of `Qwen3VLVision(cfg)`'s state dict lies in `checkpoint` (nothing read
    yet), names and shapes checked."""
    prefix = tower_prefix(checkpoint, _QWEN3_VL_PATCH) if prefix is None else prefix
    shapes = _qwen3_vl_shapes(cfg)

    def get(name: str) -> Source:
        return checkpoint.stored(prefix + name, shapes[name])

    # [D, C, t, p, p] flattened to [D, X], as the processor flattens a patch
    state = {"patch_embed.weight": Merged(Merged(Merged(get(_QWEN3_VL_PATCH), 3), 2), 1)}
    return state | {mine: get(theirs) for mine, theirs in _qwen3_vl_names(cfg).items()}


def qwen3_vl_state_dict(checkpoint: HFCheckpoint, cfg: Qwen3VLVisionConfig, prefix: str | None = None):
    """`Qwen3VLVision(cfg)`'s whole state dict, read from `checkpoint`."""
    return {name: source.full() for name, source in qwen3_vl_sources(checkpoint, cfg, prefix).items()}


def qwen3_vl_tower_tensors(state: dict[str, torch.Tensor], cfg: Qwen3VLVisionConfig, prefix: str) -> dict[str, torch.Tensor]:
    """`Qwen3VLVision(cfg)`'s state dict under a Qwen3-VL tower's names, each prefixed by `prefix`
    (a whole model's: `model.visual.`): the inverse of `qwen3_vl_sources`, each tensor contiguous."""
    tensors = {_QWEN3_VL_PATCH: state["patch_embed.weight"].reshape(_qwen3_vl_shapes(cfg)[_QWEN3_VL_PATCH])}
    tensors |= {theirs: state[mine] for mine, theirs in _qwen3_vl_names(cfg).items()}
    return {prefix + name: tensor.contiguous() for name, tensor in tensors.items()}
