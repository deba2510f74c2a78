"""FlashAttention-4's CuTe kernels (`flash-attn-4`, Dao AI Lab), where installed (`pip install
dyad[flash4]`), on Hopper and Blackwell GPUs: attention within the segments of a packed sequence
(`flash4_segments`: `dyad.kernels.varlen_attention` takes it before torch's kernel) or over whole
sequences (`flash4_attention`: the LLM's causal attention without packed samples, before SDPA).
The plain references are theirs: `varlen_attention_reference` and SDPA.

Its entry points are autograd functions; here the forward and backward kernels are custom ops, so
that a compiled block calls them instead of tracing into them. Legend: R rows of all segments,
B sequences of S rows, A query heads, G key heads, Dh and Dv the queries' and the values' head dims.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_DTYPES = (torch.bfloat16, torch.float16)

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


def flash4_segments(q_RADh: torch.Tensor, k_RGDh: torch.Tensor, v_RGDv: torch.Tensor, cu_seqlens_S1: torch.Tensor,
                    longest: int, *, scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """[R, A, Dv]: attention within each segment of `cu_seqlens_S1` (`dyad.kernels.varlen_attention.
    segment_bounds`), through FlashAttention-4; the caller checks `flash4_applies`."""
    return _flash4(q_RADh, k_RGDh, v_RGDv, cu_seqlens_S1, longest, scale, causal)


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
