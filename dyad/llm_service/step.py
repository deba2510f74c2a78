"""The LLM's part of a microbatch, shared by the workers, the layout tests and the single-process
reference (which runs it on the whole microbatch: `whole_microbatch`).

Normalisation: the caption loss is summed over the microbatch and divided by the caption-token
count of the whole global batch; the aux loss is averaged over the global batch's
microbatches. Summing microbatch losses therefore gives the global-batch loss exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dyad.llm_service.sharding import LocalMicrobatch, shard_microbatch


@dataclass
class MicrobatchLoss:
    """`lm` and `aux` are detached 0-d tensors on the loss's device: reading one is a host sync,
    so the workers add them up on the device and read the sums once the step's work is queued."""

    total: torch.Tensor  # what backward runs on
    lm: torch.Tensor
    aux: torch.Tensor


def whole_microbatch(batch, pad_id: int) -> LocalMicrobatch:
    """The single-device view: every token and every image row."""
    return shard_microbatch(batch, pad_id=pad_id, cp=1, cp_rank=0, tp=1)


def microbatch_loss(
    model: nn.Module,
    local: LocalMicrobatch,
    image_rows_NlD: torch.Tensor | None,
    *,
    global_target_tokens: int,
    global_microbatches: int,
) -> MicrobatchLoss:
    """`image_rows_NlD` are the rows `local.image_rows_Nl` selects (None: the microbatch has no
    image rows at all)."""
    positions = None if image_rows_NlD is None else local.image_positions_Nl
    logits_BSV, aux = model(
        local.input_ids_BSl,
        image_rows_NlD,
        positions,
        position_ids_S=local.positions_Sl,
        valid_BS=local.valid_BSl,
    )
    lm = model.loss_sum(logits_BSV, local.targets_BSl) / global_target_tokens
    aux = aux / global_microbatches
    return MicrobatchLoss(total=lm + aux, lm=lm.detach(), aux=aux.detach())
