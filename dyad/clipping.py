"""Clipping by the global gradient norm: the factor every gradient is multiplied by. The router
computes it from the pools' squared norms (without torch), the single-process reference from
its own; one function, so both do the same arithmetic."""

from __future__ import annotations

import math

CLIP_EPS = 1e-6  # as in torch.nn.utils.clip_grad_norm_


def clip_scale(total_sq_norm: float, max_norm: float) -> float:
    """The factor every gradient is multiplied by to clip the global norm to `max_norm`."""
    return min(1.0, max_norm / (math.sqrt(total_sq_norm) + CLIP_EPS))
