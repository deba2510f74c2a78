"""Attention over the segments of one packed sequence: every row attends to the rows of its own
segment only (an image's patches, a frame's, a packed sample's tokens: causally, each to its
segment's rows up to itself), and no segment is padded to another's length.

Legend: R rows of all segments together, A heads, Dh head dim.

`varlen_attention` runs, on CUDA for half-precision operands, one variable-length flash attention
launch over all segments, each query block reading only its own segment's keys: FlashAttention-4's
CuTe kernels (`flash-attn-4`, used on Hopper and Blackwell where installed: `pip install
dyad[flash4]`) or else flash attention's kernel in torch (`torch.nn.attention.varlen`, torch >=
2.10). Both compute a head dim such as Qwen3-VL's tower's 72 padded to 96; FlashAttention-4's
Hopper kernels take 0.6 of the time of torch's there (docs/performance.md). Elsewhere (the CPU, float32 runs
that check the math) it runs `varlen_attention_reference`: plain SDPA over each segment in turn, as
transformers' non-flash path computes it. `flash4_attention` is the same kernel for whole causal
sequences (the LLM's attention without packed samples).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F

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
        return _flash4(q_RADh, k_RGDh, v_RGDh, cu_seqlens_S1, longest, scale, causal)
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


# FlashAttention-4 (CuTe DSL), where installed. Its entry points are plain autograd functions;
# here they are custom ops, so that a compiled block calls the kernels instead of tracing into them.
FLASH4 = {"enabled": True}  # the benches switch it off to time torch's kernel on the same host


@functools.cache
def _flash4_interface():
    """flash_attn.cute's interface module, or None where flash-attn-4 is not installed."""
    try:
        from flash_attn.cute import interface
    except ImportError:
        return None
    return interface


@torch.compiler.assume_constant_result
def _flash4_arch(device_index: int) -> int:
    """The device's compute capability's major number where flash-attn-4 is installed, else 0
    (a constant of the graph where a compiled block asks)."""
    return torch.cuda.get_device_capability(device_index)[0] if _flash4_interface() is not None else 0


def flash4_applies(q_XADh: torch.Tensor, k_XGDh: torch.Tensor, v_XGDv: torch.Tensor) -> bool:
    """FlashAttention-4 takes these operands: CUDA, half precision, on Hopper (head dims up to
    256) or Blackwell (up to 128, or DeepSeek's 192 / 128), head dims multiples of 8, whole groups
    of query heads a key head (and then the values' head dim the queries')."""
    if not (FLASH4["enabled"] and q_XADh.is_cuda and q_XADh.dtype in _DTYPES and k_XGDh.dtype == q_XADh.dtype):
        return False
    arch = _flash4_arch(q_XADh.device.index if q_XADh.device.index is not None else torch.cuda.current_device())
    Dh, Dv = q_XADh.shape[-1], v_XGDv.shape[-1]
    fits = max(Dh, Dv) <= (256 if arch == 9 else 128) or (Dh, Dv) == (192, 128)
    A, G = q_XADh.shape[-2], k_XGDh.shape[-2]
    grouped_ok = A == G or Dh == Dv  # its backward takes grouped key heads only where values share the head dim
    return (arch in (9, 10) and fits and Dh % 8 == 0 and Dv % 8 == 0 and Dh == k_XGDh.shape[-1]
            and A % G == 0 and grouped_ok)


def flash4_attention(q_BSADh: torch.Tensor, k_BSGDh: torch.Tensor, v_BSGDv: torch.Tensor, *,
                     scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """[B, S, A, Dv]: attention of each of the B sequences over itself (causally with `causal`),
    through FlashAttention-4; the caller checks `flash4_applies`."""
    return _flash4(q_BSADh, k_BSGDh, v_BSGDv, None, q_BSADh.shape[1], scale, causal)


def _flash4(q, k, v, cu_seqlens, longest, scale, causal) -> torch.Tensor:
    """The kernel's output for [..., heads, Dh] operands. Head dims are padded with zero columns
    to a multiple of 32 (64 past 128), which changes no score and adds only zero output columns:
    flash-attn-4 4.0.0b36's Hopper backward sizes its float32 dq accumulators for the head dim
    rounded up to 32 but its kernels' tiles to 16, and returns a wrong dq for a head dim of 72
    (Qwen3-VL's tower; measured on an H200: tests/unit/test_flash4.py)."""
    Dh, Dv = q.shape[-1], v.shape[-1]
    scale = Dh**-0.5 if scale is None else scale
    multiple = 32 if max(Dh, Dv) <= 128 else 64
    pad_qk, pad_v = -Dh % multiple, -Dv % multiple
    if pad_qk:
        q, k = F.pad(q, (0, pad_qk)), F.pad(k, (0, pad_qk))
    if pad_v:
        v = F.pad(v, (0, pad_v))
    out = torch.ops.dyad.flash4_attention(q, k, v, cu_seqlens, longest, scale, causal)[0]
    return out[..., :Dv] if pad_v else out


def _flash4_segments(cu_seqlens: torch.Tensor | None, longest: int) -> dict:
    if cu_seqlens is None:
        return {}
    return {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens, "max_seqlen_q": longest, "max_seqlen_k": longest}


@torch.library.custom_op("dyad::flash4_attention", mutates_args=())
def _flash4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
                    longest: int, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): the output, and the log-sum-exp of each row's scores ([A, R] over segments,
    [B, A, S] over whole sequences) that the backward pass takes."""
    out, lse, *_ = _flash4_interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True,
                                             **_flash4_segments(cu_seqlens, longest))
    return out, lse


@_flash4_forward.register_fake
def _(q, k, v, cu_seqlens, longest, scale, causal):
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[-2], q.shape[0]) if cu_seqlens is not None else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("dyad::flash4_attention_backward", mutates_args=())
def _flash4_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens: torch.Tensor | None, longest: int, scale: float,
                     causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _flash4_interface()._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, causal,
                                           **_flash4_segments(cu_seqlens, longest))
    return dq, dk, dv


@_flash4_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, longest, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash4_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, longest, scale, causal = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.options = (longest, scale, causal)


def _flash4_gradients(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.dyad.flash4_attention_backward(dout, q, k, v, out, lse, cu_seqlens, *ctx.options)
    return dq, dk, dv, None, None, None, None


_flash4_forward.register_autograd(_flash4_gradients, setup_context=_flash4_setup)
