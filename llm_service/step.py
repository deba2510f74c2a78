"""The LLM's part of a microbatch, shared by the worker and the single-process reference.

Normalisation: the caption loss is summed over the microbatch and divided by the caption-token
count of the whole global batch; the aux loss is averaged over the global batch's
microbatches. Summing microbatch losses therefore gives the global-batch loss exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dyad.llm_service.model import caption_loss_sum


@dataclass
class MicrobatchLoss:
    total: torch.Tensor  # what backward runs on
    lm: float
    aux: float


def microbatch_loss(
    model: nn.Module,
    batch,
    image_rows_RD: torch.Tensor | None,
    *,
    global_target_tokens: int,
    global_microbatches: int,
) -> MicrobatchLoss:
    logits_BSV, aux = model(batch.input_ids, image_rows_RD, batch.image_positions)
    lm = caption_loss_sum(logits_BSV, batch.targets) / global_target_tokens
    aux = aux / global_microbatches
    return MicrobatchLoss(total=lm + aux, lm=float(lm.detach()), aux=float(aux.detach()))

