"""What the native-resolution tests share: a tiny random Qwen3-VL-MoE saved with transformers (the
whole model, or its vision tower alone) beside its Qwen2-VL image processor's config, and
conversations whose images come in several sizes, each giving its own number of tokens."""

from __future__ import annotations

import json

from tests.helpers.conversations import tokenizer_dir, write_images, write_jsonl

OUT = 64  # the tower's out_hidden_size: the LLM's dim (dyad's default LLM's)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[0], num_position_embeddings=16,
              out_hidden_size=OUT)
TEXT = dict(vocab_size=64, hidden_size=OUT, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=2, num_experts_per_tok=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [8, 4, 4]})
# Sides resized to multiples of 8 (patch 4 x merge 2) with an area in [256, 4096] pixels.
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "size": {"shortest_edge": 256, "longest_edge": 4096},
             "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5]}
# (width, height) -> resized to 40x24: 15 tokens; 48x72 (over max_pixels): 54; 16x16: 4; 16x40: 10
SIZES = [(37, 23), (64, 96), (20, 12), (16, 40)]
TOKENS = [15, 54, 4, 10]


def qwen3_vl_checkpoint(path, *, whole: bool = True, weights: bool = True, vocab_size: int = TEXT["vocab_size"]):
    """A tiny random Qwen3-VL-MoE (`whole`), or its vision tower alone, saved in `path` with its
    preprocessor_config.json (without `weights`: the configs alone), its LLM's vocabulary `vocab_size`
    rows; the transformers model (config)."""
    import torch
    import transformers

    from tests.helpers.hf_models import make_norms_and_biases_matter

    if whole:
        text = {**TEXT, "vocab_size": vocab_size}
        config = transformers.Qwen3VLMoeConfig(vision_config=VISION, text_config=text, tie_word_embeddings=False)
    else:
        config = transformers.Qwen3VLMoeVisionConfig(**VISION)
    path.mkdir(parents=True, exist_ok=True)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    if not weights:
        config.save_pretrained(path)
        return config
    torch.manual_seed(0)
    kind = transformers.Qwen3VLMoeForConditionalGeneration if whole else transformers.Qwen3VLMoeVisionModel
    model = make_norms_and_biases_matter(kind(config).float().eval(), bias_std=0.2)
    model.save_pretrained(path)
    return model


def native_conversations(root, samples: int = 12):
    """(a JSONL of `samples` conversations, each with one or two images of `SIZES`, every fourth
    held out; its tokenizer.json with a chat template)."""
    tokenizer = tokenizer_dir(root / "tok")
    names = write_images(root, SIZES)
    records = []
    for k in range(samples):
        images = [names[k % len(names)]] + ([names[(k + 1) % len(names)]] if k % 3 == 0 else [])
        question = "<image>\n" * len(images) + "What is this ?"
        records.append({"images": images, "split": "heldout" if k % 4 == 3 else "train", "conversations": [
            {"from": "human", "value": question}, {"from": "gpt", "value": "A cat ." if k % 2 else "Grey ."},
            {"from": "human", "value": "What colour ?"}, {"from": "gpt", "value": "Grey cat ."}]})
    return write_jsonl(root / "conversations.jsonl", records), tokenizer
