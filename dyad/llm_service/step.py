"""The LLM's part of a microbatch, shared by the workers, the layout tests and the single-process
reference (which runs it on the whole microbatch: `whole_microbatch`); and its part of an
evaluation (`heldout_microbatch`).

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


def whole_microbatch(batch, pad_id: int, *, multimodal_rope: bool = False) -> LocalMicrobatch:
    """The single-device view: every token and every image row."""
    return shard_microbatch(batch, pad_id=pad_id, cp=1, cp_rank=0, tp=1, multimodal_rope=multimodal_rope)


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
    logits_BSV, aux = _forward(model, local, image_rows_NlD)
    lm = model.loss_sum(logits_BSV, local.targets_BSl) / global_target_tokens
    aux = aux / global_microbatches
    return MicrobatchLoss(total=lm + aux, lm=lm.detach(), aux=aux.detach())


def _forward(model: nn.Module, local: LocalMicrobatch, image_rows_NlD: torch.Tensor | None):
    """(logits_BSV, aux) of the shard `local`, its image rows spliced where it has any."""
    args, kwargs = model_inputs(model, local, image_rows_NlD)
    return model(*args, **kwargs)


def model_inputs(model: nn.Module, local: LocalMicrobatch, image_rows_NlD: torch.Tensor | None) -> tuple[tuple, dict]:
    """`MoELM.forward`'s arguments (positional, keyword) for the shard `local` and its image rows:
    each row its merged token, then each DeepStack level's (llm.deepstack_levels), side by side."""
    positions = deepstack = None
    if image_rows_NlD is not None:
        positions = local.image_positions_Nl
        image_rows_NlD, *deepstack = image_rows_NlD.split(model.cfg.dim, dim=1)
    multimodal = local.rope_positions_3BSl is not None  # its positions restart at each packed sample already
    return (local.input_ids_BSl, image_rows_NlD, positions), dict(
        position_ids_S=local.positions_Sl, valid_BS=local.valid_BSl, rope_positions_3BS=local.rope_positions_3BSl,
        deepstack_embeds=deepstack, documents_BS=local.documents_BSl,
        sample_positions_BS=None if multimodal else local.sample_positions_BSl, document_bounds=local.document_bounds,
    )


@dataclass
class HeldOut:
    lm: torch.Tensor  # the microbatch's caption loss, divided by the held-out caption tokens
    checked_B: torch.Tensor  # per sample: its answer tokens held here
    wrong_B: torch.Tensor  # of them, those whose target is not the logits' argmax


@torch.no_grad()
def heldout_microbatch(
    model: nn.Module,
    local: LocalMicrobatch,
    image_rows_NlD: torch.Tensor | None,
    answer_spans_B2: torch.Tensor,
    *,
    heldout_target_tokens: int,
) -> HeldOut:
    """The microbatch's held-out loss and answer checks, no gradient. `answer_spans_B2` holds
    each sample's [start, stop) of sequence positions whose targets are its answer
    (`dyad.data.answer_targets`); the shard checks those among its own columns."""
    logits_BSV, _ = _forward(model, local, image_rows_NlD)
    return held_out(model, logits_BSV, local, answer_spans_B2, heldout_target_tokens=heldout_target_tokens)


@torch.no_grad()
def held_out(
    model: nn.Module, logits_BSV: torch.Tensor, local: LocalMicrobatch, answer_spans_B2: torch.Tensor, *,
    heldout_target_tokens: int,
) -> HeldOut:
    """`heldout_microbatch` of the logits the model gave the shard (a pipeline's last stage has them)."""
    lm = model.loss_sum(logits_BSV, local.targets_BSl) / heldout_target_tokens
    positions_1S = local.positions_Sl.unsqueeze(0)
    answer_BS = (positions_1S >= answer_spans_B2[:, :1]) & (positions_1S < answer_spans_B2[:, 1:])
    missed_BS = answer_BS & ~model.targets_predicted(logits_BSV, local.targets_BSl)
    return HeldOut(lm=lm, checked_B=answer_BS.sum(1), wrong_B=missed_BS.sum(1))
