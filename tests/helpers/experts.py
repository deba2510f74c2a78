"""The MoE expert weights in either gate-up layout (`llm.moe.gate_up`)."""

from __future__ import annotations

import torch

from dyad.llm_service.moe import MoELayer


def interleave_gate_up(w1_EDF: torch.Tensor, w3_EDF: torch.Tensor) -> torch.Tensor:
    """The [E, D, 2F] weight whose column pairs are (w1's column, w3's column)."""
    return torch.stack([w1_EDF, w3_EDF], dim=-1).flatten(-2)


def gate_and_up(layer: MoELayer) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1_EDF, w3_EDF) of either layout: views of w13's (gate, up) columns when interleaved."""
    if layer.cfg.gate_up == "interleaved":
        return layer.w13_ED2F[..., 0::2], layer.w13_ED2F[..., 1::2]
    return layer.w1_EDF, layer.w3_EDF
