"""Attention over the segments of one packed sequence: every row attends to the rows of its own
segment only (an image's patches, a frame's, a packed sample's tokens: causally, each to its
segment's rows up to itself), and no segment is padded to another's length.

Legend: R rows of all segments together, A heads, Dh head dim.

`varlen_attention` runs, on CUDA for half-precision operands, one variable-length flash attention
launch over all segments, each query block reading only its own segment's keys: FlashAttention-4's
CuTe kernels (`flash-attn-4`, used on Hopper and Blackwell where installed: `pip install
dyad[flash4]`) or else flash attention's kernel in torch (`torch.nn.attention.varlen`, torch >=
2.10). Both compute a head dim such as Qwen3-VL's tower's 72 padded to 96; FlashAttention-4's
Hopper kernels take 0.6 of the time of torch's there (docs/performance.md). Elsewhere (the CPU,
float32 runs that check the math) it runs `varlen_attention_reference`: plain SDPA over each
segment in turn, as transformers' non-flash path computes it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dyad.kernels.flash4 import flash4_applies, flash4_segments

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None

_TAKES_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters
_DTYPES = (torch.bfloat16, torch.float16)  # flash attention's; float32 runs verify the math: they take the reference


def varlen_attention_reference(
    q_RADh: torch.Tensor, k_RGDh: torch.Tensor, v_RGDh: torch.Tensor, lengths: Sequence[int], *,
    scale: float | None = None, causal: bool = False,
) -> torch.Tensor:
    """[R, A, Dh] -> [R, A, Dh]: softmax(q k^T * scale) v within each segment of `lengths` rows
    (consecutive, summing to R); with `causal`, each row over its segment's rows up to itself.
    Keys and values may have fewer heads G (grouped-query attention: A / G queries a head);
    `scale` None: 1 / sqrt(Dh)."""
    if not lengths:
        return v_RGDh
    outs = []
    for q_LADh, k_LGDh, v_LGDh in zip(*(x.split(list(lengths)) for x in (q_RADh, k_RGDh, v_RGDh)), strict=True):
        q_ALDh, k_GLDh, v_GLDh = (x.transpose(0, 1) for x in (q_LADh, k_LGDh, v_LGDh))
        outs.append(F.scaled_dot_product_attention(q_ALDh, k_GLDh, v_GLDh, scale=scale, is_causal=causal,
                                                   enable_gqa=q_ALDh.shape[0] != k_GLDh.shape[0]).transpose(0, 1))
    return torch.cat(outs)


def segment_bounds(lengths: Sequence[int], device: torch.device | str) -> tuple[torch.Tensor, int]:
    """(cu_seqlens_S1: [n + 1] int32 segment starts and the end, on `device`; the longest segment)
    of consecutive segments of `lengths` rows: what `varlen_attention` takes. Built once a batch;
    a tensor, which a compiled caller's graph can take as a dynamic input (a list of lengths is a
    constant of the graph dynamo traces: each new set of image sizes recompiled it)."""
    cu_seqlens_S1 = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device, torch.int32)
    return cu_seqlens_S1, max(lengths, default=0)


def varlen_attention(
    q_RADh: torch.Tensor, k_RGDh: torch.Tensor, v_RGDh: torch.Tensor, cu_seqlens_S1: torch.Tensor, longest: int,
    *, scale: float | None = None, causal: bool = False,
) -> torch.Tensor:
    """`varlen_attention_reference`'s result over the segments `segment_bounds` describes; flash
    attention's kernel where it applies."""
    if flash4_applies(q_RADh, k_RGDh, v_RGDh) and cu_seqlens_S1.numel() > 1:
        return flash4_segments(q_RADh, k_RGDh, v_RGDh, cu_seqlens_S1, longest, scale=scale, causal=causal)
    if not _flash_applies(q_RADh, v_RGDh, cu_seqlens_S1):
        lengths = cu_seqlens_S1.diff().tolist()
        return varlen_attention_reference(q_RADh, k_RGDh, v_RGDh, lengths, scale=scale, causal=causal)
    grouped = {}
    if q_RADh.shape[1] != k_RGDh.shape[1]:
        if _TAKES_GQA:
            grouped = {"enable_gqa": True}
        else:  # torch 2.11's takes as many key heads as query heads: each key head repeated for its queries
            k_RGDh, v_RGDh = (x.repeat_interleave(q_RADh.shape[1] // x.shape[1], dim=1) for x in (k_RGDh, v_RGDh))
    return varlen_attn(q_RADh, k_RGDh, v_RGDh, cu_seqlens_S1, cu_seqlens_S1, longest, longest, scale=scale,
                       window_size=(-1, 0) if causal else (-1, -1), **grouped)


def _flash_applies(q_RADh: torch.Tensor, v_RGDh: torch.Tensor, cu_seqlens_S1: torch.Tensor) -> bool:
    return (varlen_attn is not None and q_RADh.is_cuda and q_RADh.dtype in _DTYPES and cu_seqlens_S1.numel() > 1
            and v_RGDh.shape[-1] == q_RADh.shape[-1])  # flash's values share the queries' head dim
