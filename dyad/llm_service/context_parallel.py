"""Context parallelism over the fused multimodal sequence.

The sequence (padded to a multiple of 2·cp) is cut into 2·cp chunks; CP rank r holds chunks r
and 2·cp-1-r ("zig-zag"), so every rank gets the same amount of causal-attention work. Attention
is exact: each rank all-gathers K and V from the group (the backward sums their gradients back)
and masks by global positions (and, in packed rows, by sample: the documents travel too).

Legend: B batch, S sequence, Sl local sequence, H heads, G kv heads, Dh head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dyad.llm_service.model import document_mask
from dyad.parallel.collectives import all_gather_cat, all_gather_sum_grad
from dyad.sequence_shards import sequence_shard


def zigzag_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by `cp_rank`, ascending; `seq_len` must be a multiple of 2·cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2*cp ({2 * cp})")
    spans = sequence_shard(seq_len, cp=cp, tp=1, cp_rank=cp_rank).spans
    return torch.cat([torch.arange(span.start, span.stop) for span in spans])


def all_gather_sequence(x_BGSlDh: torch.Tensor, group) -> torch.Tensor:
    """[..., Sl, Dh] from every rank, concatenated along the sequence (dim -2); the backward sums
    every rank's gradient for this rank's keys and values."""
    return all_gather_sum_grad(x_BGSlDh, group, x_BGSlDh.dim() - 2)


class ContextParallelAttention(nn.Module):
    """The counterpart of `Attention.core` (`CausalAttention`): causal attention of local queries
    over the whole group's keys, masked by global positions."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, q_BHSlDh, k_BGSlDh, v_BGSlDh, positions_Sl, scale: float | None = None, documents=None):
        # K and V travel in one collective (one backward reduction instead of two), side by side
        # in the features: MLA's values have their own head dim.
        Dk = k_BGSlDh.shape[-1]
        kv_BGSX = all_gather_sequence(torch.cat([k_BGSlDh, v_BGSlDh], dim=-1), self.group)
        positions_S = all_gather_cat(positions_Sl, self.group, 0)
        if documents is None:
            allowed = positions_S.unsqueeze(0) <= positions_Sl.unsqueeze(1)  # [Sl, S]
        else:  # packed rows: also within the query's own sample (`documents.ids_BS`: this rank's columns)
            every_documents_BS = all_gather_cat(documents.ids_BS, self.group, 1)
            allowed = document_mask(positions_Sl, positions_S, documents.ids_BS, every_documents_BS)  # [B, 1, Sl, S]
        return F.scaled_dot_product_attention(
            q_BHSlDh,
            kv_BGSX[..., :Dk],
            kv_BGSX[..., Dk:],
            attn_mask=allowed,
            scale=scale,
            enable_gqa=q_BHSlDh.shape[1] != k_BGSlDh.shape[1],
        )
