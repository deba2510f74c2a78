"""The dry run's parameter counts and memory estimate (dyad/router/estimate.py) on a small case
counted by hand, and its parameter counts against dyad's own models built on the meta device."""

from __future__ import annotations

import pytest

from dyad.encoder_service.config import EncoderConfig, Qwen3VLVisionConfig
from dyad.layout import EncoderLayout, LLMLayout
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.router import estimate
from dyad.router.boundary import BoundaryPlan, EncodedImage, EncoderWork

LLM = LLMConfig(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, dense_ffn_dim=12,
                dense_layers=(0,), moe=MoEConfig(num_experts=4, top_k=2, expert_dim=6))
LLM_LAYOUT = LLMLayout(tp=2, dp=2, ep=2)
ENCODER = EncoderConfig(image_size=8, patch_size=4, channels=1, dim=8, depth=2, heads=2, mlp_hidden=16, out_dim=12,
                        qkv_bias=True)
ENCODER_LAYOUT = EncoderLayout(dp=1, tp=2)


def test_the_llm_parameters_by_hand():
    parts = estimate.llm_parts(LLM, LLM_LAYOUT)
    # embedding and output 100*8 each; attention 2 layers * (wq 8*8 + wk 8*4 + wv 8*4 + wo 8*8);
    # norms 5*8; the MoE layer's router 8*4 and experts 4*3*8*6; the dense layer's FFN 3*8*12
    assert estimate.total(parts) == 800 + 800 + 384 + 40 + 32 + 576 + 288 == 2920
    assert estimate.per_token(parts) == 2920 - 576 + 576 * 2 // 4
    # tp halves the embedding, output, attention and dense FFN; ep 2 the experts
    assert estimate.per_rank(parts) == 400 + 400 + 192 + 40 + 32 + 288 + 144 == 1496


def test_the_encoder_parameters_by_hand():
    tower = estimate.encoder_tower_parts(ENCODER, ENCODER_LAYOUT)
    projector = estimate.projector_parts(ENCODER, ENCODER_LAYOUT)
    # patch 16*8+8, positions 4*8; per block qkv 8*24+24, proj 8*8 (+8 whole), fc1 8*16+16, fc2 16*8
    # (+8 whole), two norms 2*16; the final norm 16
    assert estimate.total(tower) == 136 + 32 + 2 * 552 + 2 * 48 + 16
    assert estimate.per_rank(tower) == 136 + 32 + 552 + 2 * 48 + 16
    assert (estimate.total(projector), estimate.per_rank(projector)) == (8 * 12 + 12 + 12 * 12 + 12, 126 + 12)


def test_the_counts_are_the_models_own():
    torch = pytest.importorskip("torch")
    from dyad.encoder_service.model import VisionEncoder
    from dyad.encoder_service.qwen3_vl import Qwen3VLVision
    from dyad.llm_service.model import MoELM

    qwen_like = LLMConfig(vocab_size=50, dim=16, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm="head",
                          dense_layers=(1,), moe=MoEConfig(num_experts=4, top_k=2, expert_dim=8, shared_expert_dim=12,
                                                           shared_expert_gate=True))
    olmoe_like = LLMConfig(vocab_size=50, dim=16, n_heads=4, n_kv_heads=4, qk_norm="projection", attention_bias=True,
                           dense_layers=())
    clip_like = EncoderConfig(image_size=8, patch_size=4, channels=3, dim=8, heads=2, cls_token=True, pre_norm=True,
                              patch_bias=False, final_norm=False, spatial_merge=2, out_dim=16)
    with torch.device("meta"):
        for llm in (LLM, qwen_like, olmoe_like):
            model = MoELM(llm)
            assert estimate.total(estimate.llm_parts(llm, LLMLayout())) == sum(p.numel() for p in model.parameters())
        for encoder in (ENCODER, clip_like):
            model = VisionEncoder(encoder)
            parts = estimate.encoder_tower_parts(encoder, EncoderLayout()) + estimate.projector_parts(encoder, EncoderLayout())
            assert estimate.total(parts) == sum(p.numel() for p in model.parameters())
        native = EncoderConfig(native=Qwen3VLVisionConfig(dim=16, depth=3, heads=2, mlp_hidden=24, out_dim=20,
                                                          deepstack_layers=(0, 2)))
        model = Qwen3VLVision(native.native)
        trained = estimate.encoder_tower_parts(native, EncoderLayout()) + estimate.projector_parts(native, EncoderLayout())
        held = estimate.total(estimate.held_parts(native, EncoderLayout()))
        assert held == sum(p.numel() for p in model.deepstack_mergers.parameters())
        assert estimate.total(trained) + held == sum(p.numel() for p in model.parameters())


def test_the_memory_by_hand():
    memory = estimate.state_memory(1496, 1496, working_weights=False, activations=7)
    assert (memory.weights, memory.gradients, memory.optimizer, memory.total) == (4 * 1496, 4 * 1496, 8 * 1496,
                                                                                16 * 1496 + 7)
    assert estimate.state_memory(10, 0, working_weights=True, activations=0).total == 60  # frozen: weights only
    # per token: attention 4*8 + (2*2 + 2*1)*4/2; the MoE layer 2*(2*8 + 3*6)/2, the dense one 3*12/2;
    # at 2 bytes, and float32 logits over 100/2 rows
    per_token = (2 * (32 + 12) + 34 + 18) * 2 + 50 * 4
    assert estimate.llm_activations(LLM, LLM_LAYOUT, 10, element_size=2, recompute=False) == 10 * per_token
    recomputed = (8 * 2 + 32 + 12 + 34) * 2 + 50 * 4  # block inputs, and the largest block once
    assert estimate.llm_activations(LLM, LLM_LAYOUT, 10, element_size=2, recompute=True) == 10 * recomputed
    # per position and block 4*8 + (4*8 + 2*16)/2, 4 positions, 2 blocks; per token sent 8 + 2*12/2
    per_image = (4 * 2 * 64 + 4 * 20) * 4
    assert estimate.encoder_activations(ENCODER, ENCODER_LAYOUT, 3, element_size=4, recompute=False) == 3 * per_image
    # a native tower's: per patch and block the same, 2*2 patches per token; per token the merger's 32 + 2*32/2
    native = Qwen3VLVisionConfig(dim=8, depth=2, heads=2, mlp_hidden=16, spatial_merge=2, out_dim=12)
    per_token = (4 * 2 * 64 + 64) * 4
    assert estimate.native_activations(native, ENCODER_LAYOUT, 3, element_size=4, recompute=False) == 3 * per_token


def test_what_the_plan_puts_on_a_rank():
    assert estimate.llm_tokens_per_rank([(2, 10), (3, 7)], LLMLayout(cp=2)) == 12  # 3 rows of ceil(7/2)
    work = [EncoderWork(rank, mb, tuple(EncodedImage(i, 4) for i in range(n)))
            for rank, mb, n in [(0, 0, 1), (0, 1, 2), (0, 2, 3), (1, 0, 5)]]
    plan = BoundaryPlan(hidden=8, element_size=2, encoder_work=tuple(work), transfers=(), local_rows=(),
                        encoder_patches=(24, 20), encoder_imbalance=1.0)
    assert estimate.encoder_images_in_flight(plan, rounds=[0, 1, 2], depth=2) == 5  # rank 0: rounds 1+2; rank 1: 5
    assert estimate.encoder_images_in_flight(plan, rounds=[0, 1, 2], depth=1) == 5
    assert estimate.encoder_images_in_flight(plan, rounds=[0, 0, 1], depth=1) == 5
    assert estimate.encoder_tokens_in_flight(plan, rounds=[0, 1, 2], depth=2) == 5 * 4  # their rows
