"""Which part of a microbatch one LLM rank computes on.

Ranks of one tensor-parallel group see the same tokens; ranks of one context-parallel group see
disjoint zig-zag shards of the padded sequence, as `dyad.sequence_shards` lays them out.
Padding sits after every real token, so causal attention keeps it out of every real output, and
`valid_BS` keeps it out of the losses and the router statistics.

Legend: B batch, S padded sequence, Sl local sequence, N image rows, Nl local image rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyad.data import IGNORE_INDEX
from dyad.data.batch import Batch
from dyad.kernels.host_to_device import to_device
from dyad.kernels.varlen_attention import segment_bounds
from dyad.llm_service.rope_index import batch_rope_positions
from dyad.sequence_shards import sequence_shard


@dataclass
class LocalMicrobatch:
    input_ids_BSl: torch.Tensor
    targets_BSl: torch.Tensor
    positions_Sl: torch.Tensor  # global positions of the local columns
    valid_BSl: torch.Tensor  # real (non-padding) tokens
    image_rows_Nl: torch.Tensor  # which of the microbatch's image rows land here
    image_positions_Nl: torch.Tensor  # their flat indices into B*Sl
    # The local columns' multimodal rotary positions (t, h, w), with llm.mrope_section; else None.
    rope_positions_3BSl: torch.Tensor | None = None
    # Packed rows: the local columns' samples (-1 on padding) and positions in them; else None.
    documents_BSl: torch.Tensor | None = None
    sample_positions_BSl: torch.Tensor | None = None
    # Packed rows held whole (no context parallelism): their segments for variable-length
    # attention (`MoELM(document_bounds=)`); else None.
    document_bounds: tuple[torch.Tensor, int] | None = None

    def to(self, device: torch.device | str) -> LocalMicrobatch:
        """Every field on `device`, without a host sync. Sharding the CPU batch and then moving
        the shard keeps the index work (a `nonzero`, boolean masks) off the GPU, where each would
        make the host wait for every kernel queued before it."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "document_bounds"}
        moved = {name: None if t is None else to_device(t, device) for name, t in fields.items()}
        bounds = self.document_bounds and (to_device(self.document_bounds[0], device), self.document_bounds[1])
        return LocalMicrobatch(**moved, document_bounds=bounds)


def shard_microbatch(
    batch: Batch, *, pad_id: int, cp: int, cp_rank: int, tp: int, multimodal_rope: bool = False
) -> LocalMicrobatch:
    """This rank's shard of `batch`; with `multimodal_rope` (llm.mrope_section), its columns'
    (t, h, w) rotary positions from the samples' text and image grids (`batch_rope_positions`)."""
    S = batch.input_ids.shape[1]
    S_pad, spans = sequence_shard(S, cp=cp, tp=tp, cp_rank=cp_rank)
    input_ids = _pad_columns(batch.input_ids, S_pad, pad_id)
    targets = _pad_columns(batch.targets, S_pad, IGNORE_INDEX)
    device = input_ids.device
    positions_Sl = torch.cat([torch.arange(span.start, span.stop, device=device) for span in spans])

    local_index_of = torch.full((S_pad,), -1, dtype=torch.long, device=device)
    local_index_of[positions_Sl] = torch.arange(positions_Sl.numel(), device=device)
    b_N, s_N = batch.image_positions // S, batch.image_positions % S
    local_s_N = local_index_of[s_N]
    here_N = local_s_N >= 0
    rope_3BSl = documents_BSl = sample_positions_BSl = None
    if multimodal_rope:
        rope_3BSl = _pad_columns(batch_rope_positions(batch).flatten(0, 1), S_pad, 0).view(3, -1, S_pad)[:, :, positions_Sl]
    bounds = None
    if batch.documents is not None:
        documents_BSl = _pad_columns(batch.documents, S_pad, -1)[:, positions_Sl]
        sample_positions_BSl = _pad_columns(batch.sample_positions, S_pad, 0)[:, positions_Sl]
        if cp == 1:
            bounds = document_segments(documents_BSl)
    return LocalMicrobatch(
        input_ids_BSl=input_ids[:, positions_Sl],
        targets_BSl=targets[:, positions_Sl],
        positions_Sl=positions_Sl,
        valid_BSl=positions_Sl.unsqueeze(0) < batch.lengths.to(device).unsqueeze(1),
        image_rows_Nl=here_N.nonzero().squeeze(1),
        image_positions_Nl=b_N[here_N] * positions_Sl.numel() + local_s_N[here_N],
        rope_positions_3BSl=rope_3BSl,
        documents_BSl=documents_BSl,
        sample_positions_BSl=sample_positions_BSl,
        document_bounds=bounds,
    )


def document_segments(documents_BS: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`segment_bounds` of packed rows flattened: each run of one sample's columns, and each
    row's padding, a segment (on the host, where `documents_BS` is)."""
    B, S = documents_BS.shape
    starts_BS = torch.ones(B, S, dtype=torch.bool)
    starts_BS[:, 1:] = documents_BS[:, 1:] != documents_BS[:, :-1]
    starts_T = starts_BS.reshape(-1).nonzero().squeeze(1)
    lengths = torch.diff(starts_T, append=torch.tensor([B * S])).tolist()
    return segment_bounds(lengths, documents_BS.device)


def _pad_columns(x_BS: torch.Tensor, length: int, value: int) -> torch.Tensor:
    B, S = x_BS.shape
    if S == length:
        return x_BS
    padded = x_BS.new_full((B, length), value)
    padded[:, :S] = x_BS
    return padded
