"""What a parallel counterpart that cuts parameters says about them.

A counterpart (a tensor-parallel layer, expert parallelism's part of a MoE layer) holds a
different piece of some parameters on each rank of its groups. It says which (`cuts`), and how a
piece and the single-device tensor map to each other (`gather_full`, `local_part`), so that the
gradient norm, the checks and the checkpoints (`dyad.parallel.gradients`) need no fact of any
layout: they ask the counterpart.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class ShardedParameters(ABC):
    """Mixin of a parallel counterpart (an nn.Module) whose parameters, or whose owner's, are cut
    over its groups."""

    @abstractmethod
    def cuts(self, owner: nn.Module, name: str) -> bool:
        """Whether `owner.<name>` holds a different piece on each rank; `owner` is this module, or
        the module this one is a part of."""

    @abstractmethod
    def gather_full(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """`value`, shaped like this rank's piece of the parameter `name` (the parameter, its
        gradient, an optimizer moment), at the single-device shape. Collective over the groups
        the parameter is cut over; not differentiable."""

    @abstractmethod
    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The inverse of `gather_full`: this rank's piece of the single-device tensor `full`."""
