"""Hugging Face checkpoints in dyad: `load(path)` builds dyad's single-device model from a
Hugging Face model directory and takes the same tensor inputs as the transformers class it
mirrors, so that a user (and dyad's tests) can compare the two directly:

    model = dyad.hf.load("path/to/Qwen3-30B-A3B")
    out = model(input_ids, attention_mask=attention_mask, labels=input_ids)
    out.logits, out.loss

LLM families: see `dyad.llm_service.hf.FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dyad.hf_checkpoint import HFCheckpoint
from dyad.llm_service.hf import llm_state_dict
from dyad.llm_service.hf_config import FAMILIES, llm_config
from dyad.llm_service.model import MoELM

__all__ = ["CausalLM", "CausalLMOutput", "load"]


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


def load(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """dyad's single-device model of the Hugging Face model directory `path`, its weights read
    from the directory's safetensors files (names and shapes checked)."""
    checkpoint = HFCheckpoint(path)
    family = checkpoint.config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{path}: model_type {family!r} is not one dyad loads (LLMs: {', '.join(FAMILIES)})")
    cfg = llm_config(checkpoint.config)
    with torch.device("meta"):
        model = MoELM(cfg)
    model.load_state_dict(llm_state_dict(checkpoint, cfg), assign=True, strict=True)
    return CausalLM(model.to(device=device, dtype=dtype))
