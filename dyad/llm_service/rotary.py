"""Rotary position embeddings: the frequencies (the default's, or YaRN's) and their rotation.

YaRN is transformers' `_compute_yarn_parameters` (modeling_rope_utils.py) operation for operation,
in float32 as there, so a loaded model's cos and sin are transformers' bit for bit.

Multimodal rotary (Qwen3-VL's M-RoPE) gives each token three positions (t, h, w) and turns each
frequency by one of them (`mrope_axes`); its cos and sin are per sample, [B, S, R], where the
plain rotary's are [S, R], shared by the batch. `apply_rotary` takes either.

Legend: S positions, R rotary features of a head (Dh for GQA, qk_rope_head_dim for MLA), B batch,
H heads.
"""

from __future__ import annotations

import math

import torch

from dyad.llm_service.config import LLMConfig, YarnConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_frequencies(cfg: LLMConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    """(inv_freq_R/2 in float32, the factor cos and sin are scaled by) of llm.rope_type."""
    if cfg.rope_type == "yarn":
        return yarn_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.yarn, device)
    dim = cfg.rope_dim
    return 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim), 1.0


def yarn_frequencies(dim: int, theta: float, yarn: YarnConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    """YaRN's inv_freq over `dim` rotary features and its attention factor."""
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if not attention_factor:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    low, high = _correction_range(yarn, dim, theta)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # where the original frequencies are kept (short wavelengths)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).to(dtype=torch.float32) / dim)
    interpolation, extrapolation = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return interpolation * (1 - extrapolated) + extrapolation * extrapolated, float(attention_factor)


def _correction_range(yarn: YarnConfig, dim: int, theta: float) -> tuple[float, float]:
    """The rotary dims between which YaRN ramps from keeping to interpolating the frequencies:
    those turning beta_fast and beta_slow times over the original context."""

    def dim_of(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rotary_cos_sin(positions_S: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_SR, sin_SR in float32 for the rotate-half convention at the given positions, each
    times `scale` (YaRN's attention factor; 1 by default)."""
    angles = torch.outer(positions_S.to(torch.float32), inv_freq)
    angles_SR = torch.cat([angles, angles], dim=-1)
    return angles_SR.cos() * scale, angles_SR.sin() * scale


def mrope_axes(section: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[R/2] long: which of (t, h, w) turns each frequency. Qwen3-VL interleaves them: h turns
    frequencies 1, 4, 7, ... (section[1] of them), w 2, 5, 8, ... (section[2]), t the others."""
    axes = torch.zeros(sum(section), dtype=torch.long, device=device)
    _, h, w = section
    axes[1 : 3 * h : 3] = 1
    axes[2 : 3 * w : 3] = 2
    return axes


def mrope_cos_sin(
    positions_3BS: torch.Tensor, inv_freq: torch.Tensor, scale: float, section: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_BSR, sin_BSR in float32 of multimodal rotary positions (t, h, w per token), each
    frequency turned by its axis's position (`mrope_axes`), times `scale`."""
    axes = mrope_axes(section, positions_3BS.device)
    positions_BSR2 = positions_3BS.permute(1, 2, 0)[..., axes].to(torch.float32)
    angles = positions_BSR2 * inv_freq
    angles_BSR = torch.cat([angles, angles], dim=-1)
    return angles_BSR.cos() * scale, angles_BSR.sin() * scale


def apply_rotary(x_BSHR: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """x rotated by cos and sin of [S, R] (shared by the batch) or [B, S, R] (per sample)."""
    x = x_BSHR.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos_SR.unsqueeze(-2), sin_SR.unsqueeze(-2)  # broadcast over the heads
    return (x * cos + rotated * sin).to(x_BSHR.dtype)


def deinterleave(x_BSHR: torch.Tensor) -> torch.Tensor:
    """Features (x0, x1, x2, x3, ...) as (x0, x2, ..., x1, x3, ...): DeepSeek's rotary pairs
    adjacent features; reordered, the rotate-half rotation turns the same pairs. Queries and keys
    are reordered alike, so their dot products are unchanged (transformers' `rope_interleave`
    returns this order too)."""
    return torch.cat([x_BSHR[..., 0::2], x_BSHR[..., 1::2]], dim=-1)
