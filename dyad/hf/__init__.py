"""Hugging Face checkpoints in dyad: `load(path)` builds dyad's single-device model from a
Hugging Face model directory and takes the same tensor inputs as the transformers class it
mirrors, so that a user (and dyad's tests) can compare the two directly:

    model = dyad.hf.load("path/to/Qwen3-30B-A3B")
    out = model(input_ids, attention_mask=attention_mask, labels=input_ids)
    out.logits, out.loss

    tower = dyad.hf.load("path/to/siglip-so400m-patch14-384")
    tower(pixel_values).last_hidden_state

LLM families: `dyad.llm_service.hf_config.FAMILIES`; vision towers:
`dyad.encoder_service.hf_config.FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dyad.encoder_service.hf import encoder_state_dict
from dyad.encoder_service.hf_config import FAMILIES as VISION_FAMILIES
from dyad.encoder_service.hf_config import encoder_config
from dyad.encoder_service.model import VisionEncoder
from dyad.hf_checkpoint import HFCheckpoint
from dyad.llm_service.hf import llm_state_dict
from dyad.llm_service.hf_config import FAMILIES, llm_config
from dyad.llm_service.model import MoELM
from dyad.llm_service.moe import zero_expert_counts

__all__ = ["CausalLM", "CausalLMOutput", "VisionTower", "VisionTowerOutput", "load"]


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
        valid_BS = None
        if attention_mask is not None:
            valid_BS = attention_mask.bool()
            if (valid_BS[:, 1:] & ~valid_BS[:, :-1]).any():
                raise ValueError("attention_mask must be right-padded (ones, then zeros): dyad masks causally")
        logits_BSV, _ = self.model(input_ids, valid_BS=valid_BS)
        loss = None
        if labels is not None:
            V = logits_BSV.shape[-1]
            loss = F.cross_entropy(logits_BSV[:, :-1].reshape(-1, V).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(logits=logits_BSV, loss=loss)


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


def load(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> CausalLM | VisionTower:
    """dyad's single-device model of the Hugging Face model directory `path` (an MoE LLM or a
    vision tower), its weights read from the directory's safetensors files (names and shapes
    checked)."""
    checkpoint = HFCheckpoint(path)
    family = checkpoint.config.get("model_type")
    if family in VISION_FAMILIES:
        cfg = encoder_config(checkpoint.config)
        tower = VisionEncoder(cfg)  # copied into, not assigned: its parameters keep their hooks
        state = encoder_state_dict(checkpoint, cfg)
        # The projector is dyad's (LLaVA's is the whole model's): a tower alone has none.
        state |= {name: torch.zeros(p.shape) for name, p in tower.named_parameters() if name.startswith("proj_")}
        tower.load_state_dict(state, strict=True)
        return VisionTower(tower.to(device=device, dtype=dtype))
    if family not in FAMILIES:
        known = ", ".join([*FAMILIES, *sorted(VISION_FAMILIES)])
        raise ValueError(f"{path}: model_type {family!r} is not one dyad loads ({known})")
    cfg = llm_config(checkpoint.config)
    with torch.device("meta"):
        model = MoELM(cfg)
    model.load_state_dict(llm_state_dict(checkpoint, cfg), assign=True, strict=True)
    zero_expert_counts(model)
    return CausalLM(model.to(device=device, dtype=dtype))
