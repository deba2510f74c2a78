"""A pool resolves after the pools it reads (`PoolType.reads`): the encoder's rows are as wide as
the LLM a checkpoint fixes, and its image tokens are checked against that LLM's sequence length,
not the defaults of an LLM section that names only `llm.from_hf`."""

from __future__ import annotations

import pytest

from dyad import config as config_lib
from dyad.data.digits import VOCABULARY_TEXTS
from dyad.data.tokenizer import build_word_tokenizer

transformers = pytest.importorskip("transformers")


def test_the_encoder_reads_the_resolved_llm(tmp_path):
    transformers.Qwen3MoeConfig(
        hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, intermediate_size=64, vocab_size=300,
        max_position_embeddings=1024,
    ).save_pretrained(tmp_path / "llm")
    build_word_tokenizer(VOCABULARY_TEXTS).save(tmp_path / "tokenizer.json")
    config = config_lib.from_yaml(  # 400 tokens per image: more than the default llm.max_seq_len (256)
        f"data: {{name: digits, image_size: 80, tokenizer: {tmp_path / 'tokenizer.json'}}}\n"
        f"llm: {{from_hf: {tmp_path / 'llm'}}}\n"
    )
    resolved = config_lib.resolve(config, vocab_size=32)
    assert (resolved.llm.dim, resolved.llm.max_seq_len) == (96, 1024)
    assert resolved.encoder.out_dim == 96
    assert resolved.encoder.tokens_per_image == 400


def test_a_tower_whose_patch_does_not_divide_the_default_image_size_resolves(tmp_path):
    """CLIP-L/336's patch of 14 does not divide the encoder section's default image size (16):
    the tower's patch and the data's images are taken together."""
    transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=28, patch_size=14).save_pretrained(tmp_path / "clip")
    config = config_lib.from_yaml(f"data: {{name: digits, image_size: 28, channels: 3}}\n"
                                  f"encoder: {{from_hf: {tmp_path / 'clip'}, feature_layer: -1}}\n")
    encoder = config_lib.resolve(config, vocab_size=32).encoder
    assert (encoder.patch_size, encoder.image_size, encoder.tokens_per_image) == (14, 28, 4)
