"""How a bf16 working weight names its float32 master (`dyad.working_weights` makes the pairs):
kernels that compute a weight's gradient accumulate it straight into the master."""

from __future__ import annotations

import torch
from torch import nn

MASTER_ATTRIBUTE = "_dyad_master"  # the attribute of a working weight that holds its master


def master_of(weight: torch.Tensor) -> nn.Parameter | None:
    """The float32 master of a working weight, None for any other tensor."""
    return getattr(weight, MASTER_ATTRIBUTE, None)
