"""Vision encoder: a pre-norm ViT plus an MLP projector into the LLM's hidden size. dyad's own
small one by default; with the parts the config switches on, a pretrained SigLIP or CLIP tower
(dyad/encoder_service/hf_config.py).

Legend: N images, C channels, H height, W width, P patches per image, T tokens per image sent
to the LLM (P / spatial_merge**2), X flattened patch (C * patch_size**2), D encoder dim,
O out_dim (LLM hidden size), A attention heads, Dh head dim, M mlp hidden dim.

With `spatial_merge` m > 1 the projector takes each m x m square of neighbouring patches as one
token (their features concatenated, as Qwen2-VL's merger and InternVL's pixel shuffle do), so the
LLM receives m**2 times fewer image tokens than the ViT attends over.
"""


import torch
import torch.nn.functional as F
from torch import nn

from dyad.encoder_service.config import EncoderConfig


def activation(name: str):
    """encoder.activation's function."""
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    return F.gelu


def hold_key_bias(qkv: nn.Module) -> None:
    """Zero the gradient of the key part of a fused [q | k | v] projection's bias (this rank's
    blocks, under tp): its true gradient is zero (each query's scores all shift by the same
    q . b_k), and its rounding noise would otherwise be an lr-sized AdamW step. Again after
    tensor parallelism replaces the projection."""
    if qkv.bias is None:
        return
    third = qkv.bias.shape[0] // 3

    def without_key(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[third : 2 * third] = 0
        return grad

    qkv.bias.register_hook(without_key)


class EncoderBlock(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads  # heads: this rank's, under tp
        self.attn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        # No qkv bias by default: a key bias cannot change attention (softmax is shift-invariant
        # per query), so its gradient is pure rounding noise, which Adam would turn into lr-sized
        # steps. Pretrained towers have them (encoder.qkv_bias): their key part is kept as loaded
        # and learns nothing (`hold_key_bias`).
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.qkv_bias)
        hold_key_bias(self.qkv)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.mlp_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.dim)
        self.act = activation(cfg.activation)

    def attention(self, x_NPD: torch.Tensor) -> torch.Tensor:
        N, P, _ = x_NPD.shape
        qkv_NP3ADh = self.qkv(x_NPD).view(N, P, 3, self.heads, self.head_dim)
        q_NAPDh, k_NAPDh, v_NAPDh = qkv_NP3ADh.permute(2, 0, 3, 1, 4).unbind(0)
        if q_NAPDh.numel() == 0:  # cuDNN attention returns None for an empty batch (torch 2.11)
            out_NAPDh = v_NAPDh
        else:
            out_NAPDh = F.scaled_dot_product_attention(q_NAPDh, k_NAPDh, v_NAPDh)
        return self.proj(out_NAPDh.transpose(1, 2).reshape(N, P, self.heads * self.head_dim))

    def forward(self, x_NPD: torch.Tensor) -> torch.Tensor:
        x_NPD = x_NPD + self.attention(self.attn_norm(x_NPD))
        return x_NPD + self.fc2(self.act(self.fc1(self.mlp_norm(x_NPD))))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        patch_numel = cfg.channels * cfg.patch_size**2
        self.patch_embed = nn.Linear(patch_numel, cfg.dim, bias=cfg.patch_bias)
        self.cls_token_D = nn.Parameter(torch.zeros(cfg.dim)) if cfg.cls_token else None
        self.pos_embed_PD = nn.Parameter(torch.zeros(cfg.positions, cfg.dim))  # the class token's first
        self.pre_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps) if cfg.pre_norm else nn.Identity()
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps) if cfg.final_norm else nn.Identity()
        self.proj_in = nn.Linear(cfg.merged_dim, cfg.out_dim)
        self.proj_out = nn.Linear(cfg.out_dim, cfg.out_dim)

    def patchify(self, images_NCHW: torch.Tensor) -> torch.Tensor:
        """Non-overlapping patches in row-major order, each flattened as (C, ph, pw)."""
        cfg = self.cfg
        expected = (cfg.channels, cfg.image_size, cfg.image_size)
        if images_NCHW.dim() != 4 or tuple(images_NCHW.shape[1:]) != expected:
            raise ValueError(f"images must have shape [N, {', '.join(map(str, expected))}], got {list(images_NCHW.shape)}")
        N, C = images_NCHW.shape[:2]
        p, g = cfg.patch_size, cfg.patch_grid
        images_NCHW = images_NCHW[:, :, : g * p, : g * p]  # a remainder past the last whole patch: unread
        grid = images_NCHW.reshape(N, C, g, p, g, p)  # [N, C, rows, ph, cols, pw]
        return grid.permute(0, 2, 4, 1, 3, 5).reshape(N, g * g, C * p * p)

    def merge_patches(self, x_NPD: torch.Tensor) -> torch.Tensor:
        """[N, P, D] -> [N, T, m*m*D]: each m x m square of patches (row-major squares) becomes one
        token, its patches' features concatenated row by row."""
        m, g = self.cfg.spatial_merge, self.cfg.patch_grid
        if m == 1:
            return x_NPD
        N, _, D = x_NPD.shape
        squares = x_NPD.reshape(N, g // m, m, g // m, m, D)  # [N, square row, row in square, square col, col, D]
        return squares.permute(0, 1, 3, 2, 4, 5).reshape(N, (g // m) ** 2, m * m * D)

    def features(self, images_NCHW: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, P, D]: the patches' features, the class token dropped."""
        x_NPD = self.hidden_states(images_NCHW)
        return x_NPD[:, 1:] if self.cls_token_D is not None else x_NPD

    def hidden_states(self, images_NCHW: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, positions, D]: every token after the last block (and the final
        norm, if any), the class token first (if any)."""
        patches_NPX = self.patchify(images_NCHW).to(self.patch_embed.weight.dtype)
        x_NPD = self.patch_embed(patches_NPX)
        if self.cls_token_D is not None:
            x_NPD = torch.cat([self.cls_token_D.expand(x_NPD.shape[0], 1, -1), x_NPD], dim=1)
        x_NPD = self.pre_norm(x_NPD + self.pos_embed_PD)
        for block in self.blocks:
            x_NPD = block(x_NPD)
        return self.norm(x_NPD)

    def forward(self, images_NCHW: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, tokens_per_image, out_dim]; N may be 0."""
        x_NTX = self.merge_patches(self.features(images_NCHW))
        return self.proj_out(F.gelu(self.proj_in(x_NTX)))
