"""What an image costs its encoder, as the router balances images over the encoder's dp groups
(`dyad.router.boundary.plan_boundary`): the tower's forward multiply-adds for an image of a given
number of LLM tokens, torch-free.

An image of T tokens is P = T * m**2 patches (m: the spatial merge; 1 for a tower without one,
and CLIP's class token is one more patch). A block costs, per patch, its projections
(q, k, v and out: 4 * D**2) and MLP (2 * D * M), and per pair of patches of the same image its
attention (2 * D: scores and the weighted sum): cost = depth * (P * (4 D**2 + 2 D M) + 2 D P**2).
Images of one size cost alike, so for a fixed-resolution tower balancing by cost is balancing by
count; at native resolution the quadratic term makes a large image cost more than its tokens say
(Qwen3-VL's tower: a 72 x 52-patch image costs 1.5 times its patches' share next to 16 x 16
ones). The backward pass costs about twice the forward for every term alike, so it does not
change the balance; a frozen encoder has none.
"""

from __future__ import annotations

from collections.abc import Callable

from dyad.encoder_service.config import EncoderConfig, Qwen3VLVisionConfig


def image_cost(encoder: EncoderConfig | Qwen3VLVisionConfig) -> Callable[[int], float]:
    """cost(tokens): the tower's forward multiply-adds for one image of that many LLM tokens (a
    run's native-resolution tower's where `encoder.native` holds one)."""
    patches_of = image_patches(encoder)
    encoder = _tower(encoder)
    D, M, depth = encoder.dim, encoder.mlp_dim if isinstance(encoder, EncoderConfig) else encoder.mlp_hidden, encoder.depth
    per_patch, per_pair = 4 * D * D + 2 * D * M, 2 * D

    def cost(tokens: int) -> float:
        patches = patches_of(tokens)
        return float(depth * (patches * per_patch + per_pair * patches * patches))

    return cost


def image_patches(encoder: EncoderConfig | Qwen3VLVisionConfig) -> Callable[[int], int]:
    """patches(tokens): the positions the tower attends over for one image of that many LLM
    tokens (the merged squares' patches, and a class token)."""
    encoder = _tower(encoder)
    m, extra = encoder.spatial_merge, int(getattr(encoder, "cls_token", False))
    return lambda tokens: tokens * m * m + extra


def _tower(encoder: EncoderConfig | Qwen3VLVisionConfig) -> EncoderConfig | Qwen3VLVisionConfig:
    if isinstance(encoder, EncoderConfig) and encoder.native is not None:
        return encoder.native
    return encoder
