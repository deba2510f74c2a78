"""Attention over the segments of one packed sequence: every row attends to the rows of its own
segment only (an image's patches, a frame's, a packed sample's tokens), and no segment is padded
to another's length.

Legend: R rows of all segments together, A heads, Dh head dim.

`varlen_attention` runs flash attention's variable-length kernel (`torch.nn.attention.varlen`,
torch >= 2.10) on CUDA for half-precision operands: one launch over all segments, each query
block reading only its own segment's keys. Elsewhere (the CPU, float32 runs that check the math)
it runs `varlen_attention_reference`: plain SDPA over each segment in turn, as transformers'
non-flash path computes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None

_DTYPES = (torch.bfloat16, torch.float16)  # flash attention's; float32 runs verify the math: they take the reference


def varlen_attention_reference(
    q_RADh: torch.Tensor, k_RADh: torch.Tensor, v_RADh: torch.Tensor, lengths: Sequence[int], *, scale: float,
) -> torch.Tensor:
    """[R, A, Dh] -> [R, A, Dh]: softmax(q k^T * scale) v within each segment of `lengths` rows
    (consecutive, summing to R), non-causal."""
    if not lengths:
        return v_RADh
    outs = []
    for q_LADh, k_LADh, v_LADh in zip(*(x.split(list(lengths)) for x in (q_RADh, k_RADh, v_RADh)), strict=True):
        q_ALDh, k_ALDh, v_ALDh = (x.transpose(0, 1) for x in (q_LADh, k_LADh, v_LADh))
        outs.append(F.scaled_dot_product_attention(q_ALDh, k_ALDh, v_ALDh, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def segment_bounds(lengths: Sequence[int], device: torch.device | str) -> tuple[torch.Tensor, int]:
    """(cu_seqlens_S1: [n + 1] int32 segment starts and the end, on `device`; the longest segment)
    of consecutive segments of `lengths` rows: what `varlen_attention` takes. Built once a batch;
    a tensor, which a compiled caller's graph can take as a dynamic input (a list of lengths is a
    constant of the graph dynamo traces: each new set of image sizes recompiled it)."""
    cu_seqlens_S1 = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device, torch.int32)
    return cu_seqlens_S1, max(lengths, default=0)


def varlen_attention(
    q_RADh: torch.Tensor, k_RADh: torch.Tensor, v_RADh: torch.Tensor, cu_seqlens_S1: torch.Tensor, longest: int,
    *, scale: float,
) -> torch.Tensor:
    """`varlen_attention_reference`'s result over the segments `segment_bounds` describes; flash
    attention's kernel where it applies."""
    if not _flash_applies(q_RADh, cu_seqlens_S1):
        return varlen_attention_reference(q_RADh, k_RADh, v_RADh, cu_seqlens_S1.diff().tolist(), scale=scale)
    return varlen_attn(q_RADh, k_RADh, v_RADh, cu_seqlens_S1, cu_seqlens_S1, longest, longest, scale=scale)


def _flash_applies(q_RADh: torch.Tensor, cu_seqlens_S1: torch.Tensor) -> bool:
    return varlen_attn is not None and q_RADh.is_cuda and q_RADh.dtype in _DTYPES and cu_seqlens_S1.numel() > 1
