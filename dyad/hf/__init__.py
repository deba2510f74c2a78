"""Hugging Face checkpoints in dyad: `load(path)` builds dyad's single-device model from a
Hugging Face model directory and takes the same tensor inputs as the transformers class it
mirrors, so that a user (and dyad's tests) can compare the two directly:

    model = dyad.hf.load("path/to/Qwen3-30B-A3B")
    out = model(input_ids, attention_mask=attention_mask, labels=input_ids)
    out.logits, out.loss

    tower = dyad.hf.load("path/to/siglip-so400m-patch14-384")
    tower(pixel_values).last_hidden_state

    whole = dyad.hf.load("path/to/a-llava")  # a tower, its projector and an MoE LLM
    whole(input_ids, pixel_values=pixel_values, attention_mask=attention_mask).logits

    qwen = dyad.hf.load("path/to/Qwen3-VL-30B-A3B-Instruct")  # as Qwen3VLMoeForConditionalGeneration
    qwen(input_ids, attention_mask, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
         mm_token_type_ids=mm_token_type_ids, labels=labels).loss  # what its processor returns

    vision = dyad.hf.load_qwen3_vl_vision("path/to/Qwen3-VL-30B-A3B-Instruct")  # or a tower alone
    out = vision(pixel_values, grid_thw)  # as Qwen3-VL's image processor gives them
    out.pooler_output, out.deepstack_features  # the merged image tokens, the DeepStack features

LLM families: `dyad.llm_service.hf_config.FAMILIES`; vision towers:
`dyad.encoder_service.hf_config.FAMILIES` and Qwen3-VL's (`QWEN3_VL_VISION`); a LLaVA
(`LlavaForConditionalGeneration`) of any of the former, its image placeholders
(`image_token_index`) replaced by the projected features of its images; a whole Qwen3-VL-MoE
(`Qwen3VLMoeForConditionalGeneration`) or Qwen3-VL (`Qwen3VLForConditionalGeneration`, its
decoder dense), written back by `qwen3_vl_to_hf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dyad.encoder_service.config import Qwen3VLVisionConfig
from dyad.encoder_service.hf import encoder_state_dict, qwen3_vl_state_dict, qwen3_vl_tower_tensors
from dyad.encoder_service.hf_config import FAMILIES as VISION_FAMILIES
from dyad.encoder_service.hf_config import (
    QWEN3_VL,
    QWEN3_VL_VISION,
    encoder_config,
    llava_feature_layer,
    qwen3_vl_vision_config,
)
from dyad.encoder_service.model import VisionEncoder
from dyad.encoder_service.qwen3_vl import Qwen3VLVision
from dyad.hf_checkpoint import HFCheckpoint
from dyad.llm_service.config import LLMConfig
from dyad.llm_service.hf import hf_tensors, llm_state_dict
from dyad.llm_service.hf_config import FAMILIES, exported_config, llm_config, text_config
from dyad.llm_service.model import MoELM
from dyad.llm_service.moe import zero_expert_counts
from dyad.llm_service.rope_index import IMAGE, rope_index

__all__ = [
    "CausalLM", "CausalLMOutput", "Llava", "Qwen3VL", "Qwen3VLVisionOutput", "Qwen3VLVisionTower", "VisionTower",
    "VisionTowerOutput", "load", "load_qwen3_vl_vision", "qwen3_vl_to_hf",
]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, S, V], float32
    loss: torch.Tensor | None = None  # mean cross-entropy of the shifted labels (with `labels`)


class CausalLM(nn.Module):
    """A `MoELM` (`.model`) behind a transformers causal-LM's forward: `input_ids`, an optional
    right-padded `attention_mask`, optional `labels` (-100: ignored; shifted here, as transformers
    does)."""

    def __init__(self, model: MoELM):
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        logits_BSV, _ = self.model(input_ids, valid_BS=_valid(attention_mask))
        return _output(logits_BSV, labels)


def _valid(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[B, S] bool of the real tokens, refusing a mask that is not right-padded."""
    if attention_mask is None:
        return None
    valid_BS = attention_mask.bool()
    if (valid_BS[:, 1:] & ~valid_BS[:, :-1]).any():
        raise ValueError("attention_mask must be right-padded (ones, then zeros): dyad masks causally")
    return valid_BS


def _output(logits_BSV: torch.Tensor, labels: torch.Tensor | None) -> CausalLMOutput:
    """The logits, and with `labels` (-100: ignored) the mean cross-entropy of the next tokens."""
    loss = None
    if labels is not None:
        V = logits_BSV.shape[-1]
        loss = F.cross_entropy(logits_BSV[:, :-1].reshape(-1, V).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
    return CausalLMOutput(logits=logits_BSV, loss=loss)


class Llava(nn.Module):
    """A `VisionEncoder` (`.encoder`: the tower to its feature layer and the projector) and a
    `MoELM` (`.llm`) behind transformers' `LlavaForConditionalGeneration` forward: each image's
    projected features, in order, replace the `image_token_id` placeholders of `input_ids`."""

    def __init__(self, encoder: VisionEncoder, llm: MoELM, image_token_id: int):
        super().__init__()
        self.encoder, self.llm, self.image_token_id = encoder, llm, image_token_id

    def forward(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        rows_ND = positions_N = None
        placeholders_N = (input_ids.flatten() == self.image_token_id).nonzero().flatten()
        if pixel_values is not None:
            rows_ND = self.encoder(pixel_values.to(self.encoder.patch_embed.weight.dtype)).flatten(0, 1)
            positions_N = placeholders_N
        _check_placeholders(placeholders_N, rows_ND, self.image_token_id)
        logits_BSV, _ = self.llm(input_ids, rows_ND, positions_N, valid_BS=_valid(attention_mask))
        return _output(logits_BSV, labels)


def _check_placeholders(placeholders_N: torch.Tensor, rows_ND: torch.Tensor | None, image_token_id: int) -> None:
    """A ValueError unless there is one image row for each placeholder."""
    rows = 0 if rows_ND is None else len(rows_ND)
    if len(placeholders_N) != rows:
        raise ValueError(f"input_ids hold {len(placeholders_N)} image placeholders (id {image_token_id}), "
                         f"the images give {rows} rows")


class Qwen3VL(nn.Module):
    """A `Qwen3VLVision` (`.encoder`) and a `MoELM` (`.llm`) behind transformers'
    `Qwen3VLMoeForConditionalGeneration` forward for images (and `Qwen3VLForConditionalGeneration`'s):
    the merged tokens of the images, in order, replace the `image_token_id` placeholders of
    `input_ids`, each DeepStack level is added at the same places after its LLM layer, and the
    multimodal rotary positions are `rope_index`'s of `mm_token_type_ids` and `image_grid_thw`
    (which images need, as transformers needs them; without images every axis counts the
    sequence). The loss is the shifted cross-entropy alone, as transformers' unless its config
    says `output_router_logits`."""

    def __init__(self, encoder: Qwen3VLVision, llm: MoELM, image_token_id: int):
        super().__init__()
        self.encoder, self.llm, self.image_token_id = encoder, llm, image_token_id

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        valid_BS = _valid(attention_mask)
        placeholders_BS = input_ids == self.image_token_id
        placeholders_N = placeholders_BS.flatten().nonzero().flatten()
        rows_ND = positions_N = positions_3BS = deepstack = None
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw must be given together")
        if pixel_values is not None:
            if mm_token_type_ids is None:
                raise ValueError("images need mm_token_type_ids (the processor returns them with input_ids): "
                                 "the multimodal rotary positions come from them")
            if not torch.equal((mm_token_type_ids == IMAGE).to(placeholders_BS.device), placeholders_BS):
                raise ValueError(f"mm_token_type_ids must mark as images ({IMAGE}) exactly the image placeholders "
                                 f"(input_ids == {self.image_token_id})")
            rows_ND, deepstack = self.encoder(pixel_values, image_grid_thw)
            positions_N = placeholders_N
            positions_3BS = rope_index(mm_token_type_ids, image_grid_thw, attention_mask,
                                       spatial_merge_size=self.encoder.cfg.spatial_merge).to(input_ids.device)
        _check_placeholders(placeholders_N, rows_ND, self.image_token_id)
        logits_BSV, _ = self.llm(input_ids, rows_ND, positions_N, valid_BS=valid_BS, rope_positions_3BS=positions_3BS,
                                 deepstack_embeds=deepstack)
        return _output(logits_BSV, labels)


@dataclass
class VisionTowerOutput:
    last_hidden_state: torch.Tensor  # [N, tokens, D]


class VisionTower(nn.Module):
    """A `VisionEncoder` (`.model`, without its projector's use) behind a transformers vision
    model's forward: `pixel_values` [N, C, H, W] -> `.last_hidden_state`."""

    def __init__(self, model: VisionEncoder):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> VisionTowerOutput:
        return VisionTowerOutput(last_hidden_state=self.model.hidden_states(pixel_values))


@dataclass
class Qwen3VLVisionOutput:  # transformers' names
    last_hidden_state: torch.Tensor  # [patches, D]: the last block's output
    pooler_output: torch.Tensor  # [tokens, out_dim]: the merged image tokens
    deepstack_features: list[torch.Tensor]  # a [tokens, out_dim] per DeepStack layer


class Qwen3VLVisionTower(nn.Module):
    """A `Qwen3VLVision` (`.model`) behind transformers' Qwen3-VL vision model's forward:
    `pixel_values` [patches, C * temporal * p * p] and `grid_thw` [images, 3], as Qwen3-VL's image
    processor gives them (`image_grid_thw`)."""

    def __init__(self, model: Qwen3VLVision):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Qwen3VLVisionOutput:
        hidden_PD, deepstack = self.model.hidden_states(pixel_values, grid_thw)
        return Qwen3VLVisionOutput(hidden_PD, self.model.merger(hidden_PD), deepstack)


def load_qwen3_vl_vision(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> Qwen3VLVisionTower:
    """The vision tower of a Qwen3-VL(-MoE) directory (the whole model's or one saved alone)."""
    return Qwen3VLVisionTower(_qwen3_vl_vision(HFCheckpoint(path)).to(device=device, dtype=dtype))


def _qwen3_vl_vision(checkpoint: HFCheckpoint) -> Qwen3VLVision:
    cfg = qwen3_vl_vision_config(checkpoint.config)
    with torch.device("meta"):
        model = Qwen3VLVision(cfg)
    model.load_state_dict(qwen3_vl_state_dict(checkpoint, cfg), assign=True, strict=True)
    return model


def qwen3_vl_to_hf(
    encoder_state: dict[str, torch.Tensor], encoder_cfg: Qwen3VLVisionConfig,
    llm_state: dict[str, torch.Tensor], llm_cfg: LLMConfig, source: dict,
) -> tuple[dict[str, torch.Tensor], dict]:
    """A whole Qwen3-VL(-MoE)'s Hugging Face tensors and config.json from dyad's state dicts (a
    `Qwen3VL`'s `.encoder` and `.llm`): the tower under `model.visual.`, the language model
    under `model.language_model.` (fused experts as transformers 5 saves them), its head as
    `lm_head.weight`, never tied (dyad loads no tied head); the config `source`'s (the
    config.json of the checkpoint the model came from) with `llm_cfg`'s vocabulary. What
    transformers' `from_pretrained` loads and computes dyad's logits with."""
    text = text_config(source)
    tensors = qwen3_vl_tower_tensors(encoder_state, encoder_cfg, "model.visual.")
    tensors |= hf_tensors(llm_state, llm_cfg, text["model_type"], decoder="model.language_model.")
    return tensors, source | {"text_config": exported_config(text, llm_cfg), "tie_word_embeddings": False}


def load(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> CausalLM | VisionTower | Llava | Qwen3VL | Qwen3VLVisionTower:
    """dyad's single-device model of the Hugging Face model directory `path` (an MoE LLM, a
    vision tower, or a LLaVA of the two; a whole Qwen3-VL(-MoE), or its tower saved alone), its
    weights read from the directory's safetensors files (names and shapes checked)."""
    checkpoint = HFCheckpoint(path)
    family = checkpoint.config.get("model_type")
    if family == "llava":
        llm = _llm(checkpoint)
        cfg = encoder_config(checkpoint.config, feature_layer=llava_feature_layer(checkpoint.config),
                             out_dim=llm.cfg.dim)
        encoder = VisionEncoder(cfg)  # copied into, not assigned: its parameters keep their hooks
        encoder.load_state_dict(encoder_state_dict(checkpoint, cfg), strict=True)
        image_token_id = checkpoint.config.get("image_token_index", checkpoint.config.get("image_token_id"))
        return Llava(encoder, llm, image_token_id).to(device=device, dtype=dtype)
    if family in VISION_FAMILIES:
        cfg = encoder_config(checkpoint.config)
        tower = VisionEncoder(cfg)
        state = encoder_state_dict(checkpoint, cfg)
        # The projector is dyad's (LLaVA's is the whole model's): a tower alone has none.
        state |= {name: torch.zeros(p.shape) for name, p in tower.named_parameters() if name.startswith("proj_")}
        tower.load_state_dict(state, strict=True)
        return VisionTower(tower.to(device=device, dtype=dtype))
    if family in QWEN3_VL:
        model = Qwen3VL(_qwen3_vl_vision(checkpoint), _llm(checkpoint), checkpoint.config["image_token_id"])
        return model.to(device=device, dtype=dtype)
    if family in QWEN3_VL_VISION:
        return load_qwen3_vl_vision(path, dtype=dtype, device=device)
    if family not in FAMILIES:
        known = ", ".join([*FAMILIES, *sorted(VISION_FAMILIES), *QWEN3_VL_VISION, *QWEN3_VL, "llava"])
        raise ValueError(f"{path}: model_type {family!r} is not one dyad loads ({known})")
    return CausalLM(_llm(checkpoint).to(device=device, dtype=dtype))


def _llm(checkpoint: HFCheckpoint) -> MoELM:
    cfg = llm_config(checkpoint.config)
    with torch.device("meta"):
        model = MoELM(cfg)
    model.load_state_dict(llm_state_dict(checkpoint, cfg), assign=True, strict=True)
    zero_expert_counts(model)
    return model
