"""The MoE experts' w1 and w3, which the layer keeps as one weight of (gate, up) column pairs."""

from __future__ import annotations

import torch

from dyad.llm_service.moe import MoELayer


def interleave_gate_up(w1_EDF: torch.Tensor, w3_EDF: torch.Tensor) -> torch.Tensor:
    """The [E, D, 2F] weight whose column pairs are (w1's column, w3's column)."""
    return torch.stack([w1_EDF, w3_EDF], dim=-1).flatten(-2)


def gate_and_up(layer: MoELayer) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1_EDF, w3_EDF): views of w13's (gate, up) columns."""
    return layer.w13_ED2F[..., 0::2], layer.w13_ED2F[..., 1::2]
