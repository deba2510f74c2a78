"""Qwen3-VL's vision tower (transformers' Qwen3VLVisionModel, the same in Qwen3-VL-MoE) at native
resolution: the images of a batch, each of its own patch grid, form one packed sequence of
patches in which each image attends only to itself (dyad/kernels/varlen_attention.py), no image
padded to another's size.

Input as Qwen3-VL's image processor gives it: `pixel_values` [P, X], the images' patches one
image after another, each image's in merge-window order (its m x m squares of patches row by row,
the patches of each square row by row), and `grid_thw` [N, 3], each image's patch grid (frames t,
rows h, columns w; P = sum of t*h*w). Output: the merged tokens [T, O], each m*m consecutive
patches one token, and the DeepStack features, one more [T, O] per block of
`cfg.deepstack_layers` (the LLM adds them to the hidden states of its first layers).

Positions enter twice: a learned square of embeddings (`position_grid` a side) resampled
bilinearly to each image's grid and added to the patches, and a 2-D rotary in every block's
attention (half of each head turned by the patch's row, half by its column).

Legend: N images, P patches of all images, X flattened patch (C * temporal * p * p), D dim,
A heads, Dh head dim, M mlp hidden, E merged patch (D * m**2), T merged tokens (P / m**2),
O out dim, G learned positions (position_grid**2), K bilinear taps (4), F rotary frequencies
per axis (Dh / 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dyad.encoder_service.config import Qwen3VLVisionConfig
from dyad.encoder_service.model import activation
from dyad.kernels.varlen_attention import segment_bounds, varlen_attention


@dataclass
class PatchGrid:
    """Where each patch of a batch lies in its image, from `grid_thw` alone."""

    row_P: torch.Tensor  # long
    col_P: torch.Tensor
    height_P: torch.Tensor  # its image's rows of patches
    width_P: torch.Tensor
    lengths: list[int]  # patches of each attention segment (a frame of an image), in order


def patch_grid(grid_thw_N3: torch.Tensor, merge: int) -> PatchGrid:
    """Each patch's (row, column) in merge-window order, frame after frame of each image."""
    rows, cols, heights, widths, lengths = [], [], [], [], []
    for t, h, w in grid_thw_N3.tolist():
        square = (h // merge, w // merge, merge, merge)  # [square row, square col, row in it, col in it]
        in_square = torch.arange(merge)
        row = (torch.arange(h // merge).view(-1, 1, 1, 1) * merge + in_square.view(1, 1, -1, 1)).expand(square)
        col = (torch.arange(w // merge).view(1, -1, 1, 1) * merge + in_square.view(1, 1, 1, -1)).expand(square)
        rows.append(row.flatten().repeat(t))
        cols.append(col.flatten().repeat(t))
        heights.append(torch.full((t * h * w,), h))
        widths.append(torch.full((t * h * w,), w))
        lengths += [h * w] * t
    empty = torch.zeros(0, dtype=torch.long)
    return PatchGrid(*(torch.cat(x) if x else empty for x in (rows, cols, heights, widths)), lengths)


def _axis_taps(index_P: torch.Tensor, size_P: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two neighbours on a `side`-long axis of the learned grid of a patch at `index` of
    `size` (corners aligned: the first and last patch sit on the first and last embedding) and
    their linear weights: [P, 2] taps, [P, 2] float32 weights."""
    src_P = index_P.float() * (side - 1) / (size_P - 1).clamp(min=1)
    floor_P = src_P.floor()
    offsets_2 = torch.arange(2, device=index_P.device)
    taps_P2 = (floor_P.long()[:, None] + offsets_2).clamp(0, side - 1)
    weights_P2 = (1 - (src_P[:, None] - floor_P[:, None] - offsets_2).abs()).clamp(min=0)
    return taps_P2, weights_P2


def bilinear_taps(grid: PatchGrid, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, K] rows of the learned [side * side, D] position table and [P, K] weights whose sum is
    each patch's position embedding: the table resized bilinearly to its image's grid."""
    row_taps, row_weights = _axis_taps(grid.row_P, grid.height_P, side)
    col_taps, col_weights = _axis_taps(grid.col_P, grid.width_P, side)
    taps_PK = (row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1)
    weights_PK = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
    return taps_PK, weights_PK


def rotary_cos_sin(grid: PatchGrid, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, Dh] float32 cos and sin of the 2-D rotary: the first quarter of the frequencies the
    patch's row, the second its column, the second half of the head the first's repeat (the
    rotation pairs element i with i + Dh/2)."""
    half = head_dim // 2
    inv_freq_F = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    angles_P2F = torch.stack([grid.row_P, grid.col_P], dim=1)[..., None].float() * inv_freq_F
    angles_PDh = angles_P2F.flatten(1).repeat(1, 2)
    return angles_PDh.cos(), angles_PDh.sin()


def rotate(x_PADh: torch.Tensor, cos_PDh: torch.Tensor, sin_PDh: torch.Tensor) -> torch.Tensor:
    """The rotary applied in float32, rounded back to x's dtype."""
    x = x_PADh.float()
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos_PDh[:, None] + turned * sin_PDh[:, None]).to(x_PADh.dtype)


class Qwen3VLBlock(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim  # heads: this rank's, under tp
        self.attn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        # With the rotary the key bias moves each query's scores by a position-dependent amount:
        # unlike a plain ViT's it does learn.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.mlp_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_hidden)
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.dim)
        self.act = activation(cfg.activation)

    def attention(self, x_PD, cos_PDh, sin_PDh, cu_seqlens_S1: torch.Tensor, longest: int):
        P = x_PD.shape[0]
        q_PADh, k_PADh, v_PADh = self.qkv(x_PD).view(P, 3, self.heads, self.head_dim).unbind(1)
        q_PADh, k_PADh = rotate(q_PADh, cos_PDh, sin_PDh), rotate(k_PADh, cos_PDh, sin_PDh)
        out_PADh = varlen_attention(q_PADh, k_PADh, v_PADh, cu_seqlens_S1, longest, scale=self.head_dim**-0.5)
        return self.proj(out_PADh.reshape(P, self.heads * self.head_dim))

    def forward(self, x_PD, cos_PDh, sin_PDh, cu_seqlens_S1: torch.Tensor, longest: int) -> torch.Tensor:
        """`cu_seqlens_S1`, `longest`: the attention segments (`segment_bounds`)."""
        x_PD = x_PD + self.attention(self.attn_norm(x_PD), cos_PDh, sin_PDh, cu_seqlens_S1, longest)
        return x_PD + self.fc2(self.act(self.fc1(self.mlp_norm(x_PD))))


class PatchMerger(nn.Module):
    """Each m*m consecutive patches (one merge window) -> one token: a LayerNorm of each patch
    (the main merger) or of the merged window (`norm_merged`: DeepStack's), then fc1, exact GELU, fc2."""

    def __init__(self, cfg: Qwen3VLVisionConfig, *, norm_merged: bool):
        super().__init__()
        self.merged, self.norm_merged = cfg.merged_dim, norm_merged
        self.norm = nn.LayerNorm(cfg.merged_dim if norm_merged else cfg.dim, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.merged_dim, cfg.merged_dim)
        self.fc2 = nn.Linear(cfg.merged_dim, cfg.out_dim)

    def forward(self, x_PD: torch.Tensor) -> torch.Tensor:
        if self.norm_merged:
            x_TE = self.norm(x_PD.reshape(-1, self.merged))
        else:
            x_TE = self.norm(x_PD).reshape(-1, self.merged)
        return self.fc2(F.gelu(self.fc1(x_TE)))


class Qwen3VLVision(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.patch_numel, cfg.dim)  # the checkpoint's Conv3d, stride = kernel
        self.pos_embed_GD = nn.Parameter(torch.zeros(cfg.position_grid**2, cfg.dim))
        self.blocks = nn.ModuleList(Qwen3VLBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, norm_merged=False)
        self.deepstack_mergers = nn.ModuleList(PatchMerger(cfg, norm_merged=True) for _ in cfg.deepstack_layers)

    def forward(self, pixel_values_PX: torch.Tensor, grid_thw_N3: torch.Tensor):
        """-> (merged tokens [T, O], DeepStack features: a [T, O] per `cfg.deepstack_layers`)."""
        x_PD, deepstack = self.hidden_states(pixel_values_PX, grid_thw_N3)
        return self.merger(x_PD), deepstack

    def merged_tokens(self, pixel_values_PX: torch.Tensor, grid_thw_N3: torch.Tensor) -> torch.Tensor:
        """-> the merged tokens [T, O] alone, the DeepStack mergers not run (what crosses the
        boundary while DeepStack's features do not: each level costs a merger's two matmuls)."""
        x_PD, _ = self.hidden_states(pixel_values_PX, grid_thw_N3, deepstack=False)
        return self.merger(x_PD)

    def hidden_states(self, pixel_values_PX: torch.Tensor, grid_thw_N3: torch.Tensor, *, deepstack: bool = True):
        """-> (the last block's output [P, D], the DeepStack features; [] without `deepstack`)."""
        grid = self._grid(pixel_values_PX, grid_thw_N3)
        device = self.pos_embed_GD.device
        x_PD = self.patch_embed(pixel_values_PX.to(device, self.patch_embed.weight.dtype))
        taps_PK, weights_PK = (t.to(device) for t in bilinear_taps(grid, self.cfg.position_grid))
        pos_PD = (F.embedding(taps_PK, self.pos_embed_GD) * weights_PK[..., None]).sum(1)
        x_PD = x_PD + pos_PD.to(x_PD.dtype)
        cos_PDh, sin_PDh = (t.to(device) for t in rotary_cos_sin(grid, self.cfg.head_dim, self.cfg.rope_theta))
        cu_seqlens_S1, longest = segment_bounds(grid.lengths, device)
        features = []
        for i, block in enumerate(self.blocks):
            x_PD = block(x_PD, cos_PDh, sin_PDh, cu_seqlens_S1, longest)
            if deepstack and i in self.cfg.deepstack_layers:
                features.append(self.deepstack_mergers[len(features)](x_PD))
        return x_PD, features

    def _grid(self, pixel_values_PX: torch.Tensor, grid_thw_N3: torch.Tensor) -> PatchGrid:
        cfg, m = self.cfg, self.cfg.spatial_merge
        if grid_thw_N3.dim() != 2 or grid_thw_N3.shape[1] != 3:
            raise ValueError(f"grid_thw must have shape [images, 3] (t, h, w), got {list(grid_thw_N3.shape)}")
        grid_thw = grid_thw_N3.cpu()
        if (grid_thw < 1).any() or (grid_thw[:, 1:] % m).any():
            raise ValueError(f"grid_thw's rows and columns must be positive multiples of encoder.spatial_merge ({m}), "
                             f"got {grid_thw.tolist()}")
        patches = int(grid_thw.prod(1).sum())
        if tuple(pixel_values_PX.shape) != (patches, cfg.patch_numel):
            raise ValueError(f"pixel_values must have shape [{patches}, {cfg.patch_numel}] (grid_thw's patches, "
                             f"channels * temporal_patch * patch_size**2), got {list(pixel_values_PX.shape)}")
        return patch_grid(grid_thw, m)
