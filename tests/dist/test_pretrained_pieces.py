"""A pool's ranks read only their own pieces of a Hugging Face checkpoint: after `parallelize` has
cut the model, each rank's parameters equal its piece of the single-device model loaded whole,
and the elements it read from the safetensors files are exactly those of its pieces (tensor-
parallel rows and columns, its experts and their expert-tensor-parallel slices; not the padding of
a vocabulary split, nor the rows a tokenizer added past the checkpoint's embedding)."""

from __future__ import annotations

import pytest
import torch

from dyad import config as config_lib
from dyad.data import make_dataset
from dyad.encoder_service.parallelize import parallelize_encoder
from dyad.hf_checkpoint import HFCheckpoint
from dyad.layout import EncoderLayout, LLMLayout
from dyad.llm_service.hf_config import text_config
from dyad.llm_service.parallelize import parallelize_llm
from dyad.parallel.gradients import full_tensors, local_part, owned_parameters
from dyad.parallel.groups import ProcessGroups
from dyad.pools import pool_type
from dyad.service import build_model
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import digits_tokenizer_in

transformers = pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e '.[test]')")

GROWN = 3  # the tokenizer's ids past the checkpoint's embedding rows


class _ReadCounter:
    """A checkpoint file handle that counts the elements its slices return."""

    elements = 0

    def __init__(self, handle):
        self.handle = handle

    def get_slice(self, name):
        counter, inner = self, self.handle.get_slice(name)

        class Slice:
            def get_shape(self):
                return inner.get_shape()

            def __getitem__(self, box):
                value = inner[box]
                type(counter).elements += value.numel()
                return value

        return Slice()


def _pieces_body(rank, world_size, pool, layout, overrides):
    config = config_lib.load(None, overrides)
    config = config_lib.resolve(config, vocab_size=make_dataset(config.data).tokenizer.vocab_size)
    groups = ProcessGroups.build(layout)
    whole = build_model(config, pool)  # single-device, read whole
    model = build_model(config, pool, pretrained=False)
    if pool == "llm":
        parallelize_llm(model, groups)
    else:
        parallelize_encoder(model, groups)
    handle_of = HFCheckpoint._handle
    HFCheckpoint._handle = lambda self, name: _ReadCounter(handle_of(self, name))
    try:
        pool_type(pool).service_class().load_pretrained(model, config)
    finally:
        HFCheckpoint._handle = handle_of
    gathered, expected = full_tensors(model), dict(whole.named_parameters())
    for name, tensor in gathered.items():
        assert torch.equal(tensor, expected[name]), name
    whole_buffers = dict(whole.named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, whole_buffers[name]), name
    checkpoint = HFCheckpoint(getattr(config, pool).from_hf)
    total = sum(torch.Size(checkpoint.shape(n)).numel() for n in checkpoint.names)
    stored = _stored_elements(model, whole, pool, checkpoint)
    assert _ReadCounter.elements == stored, (rank, _ReadCounter.elements, stored)
    assert stored < 0.6 * total, (stored, total)  # under every layout here, about half the model


def _stored_elements(model, whole, pool, checkpoint) -> int:
    """The elements of this rank's pieces that come from the checkpoint: a piece of a mask of the
    loaded tensors (rows past the checkpoint's vocabulary and a projector the tower lacks: 0)."""
    count = 0
    for key, module, name, _ in owned_parameters(model):
        mask = torch.ones_like(whole.get_parameter(key), dtype=torch.int32)
        if pool == "encoder" and key.startswith(("proj_in.", "proj_out.")):
            continue
        if key in ("tok_embeddings.weight", "output.weight"):
            mask[text_config(checkpoint.config)["vocab_size"]:] = 0
        count += int(local_part(module, name, mask).sum())
    # and whole, DeepSeek-V3's expert biases (buffers, on every rank)
    return count + sum(b.numel() for key, b in model.named_buffers() if key.endswith("expert_bias_E"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Qwen3-MoE, DeepSeek-V3 and Qwen3-VL-MoE (its experts fused) of the default config's
    shape whose tokenizer (the digits' words: 19 ids, so a tp2 split pads a row) has `GROWN` more
    ids than their embeddings, and a tiny SigLIP tower."""
    root = tmp_path_factory.mktemp("hf")
    tokenizer = digits_tokenizer_in(root / "qwen3-moe")
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=tokenizer.vocab_size - GROWN, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=256, tie_word_embeddings=False,
    )).save_pretrained(root / "qwen3-moe")
    digits_tokenizer_in(root / "deepseek-v3")
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=tokenizer.vocab_size - GROWN, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=256, tie_word_embeddings=False,
    )).save_pretrained(root / "deepseek-v3")
    digits_tokenizer_in(root / "qwen3-vl-moe")
    transformers.Qwen3VLMoeForConditionalGeneration(transformers.Qwen3VLMoeConfig(
        text_config=dict(
            vocab_size=tokenizer.vocab_size - GROWN, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=256, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [3, 3, 2]},
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[]),  # the run's tower is a ViT
        tie_word_embeddings=False,
    )).save_pretrained(root / "qwen3-vl-moe")
    transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=16,
        patch_size=4, num_channels=3, vision_use_head=False,
    )).save_pretrained(root / "siglip")
    return root


@pytest.mark.parametrize("family, layout", [
    ("qwen3-moe", LLMLayout(tp=2, ep=2)), ("qwen3-moe", LLMLayout(tp=2, dp=2, etp=2, ep=2)),
    ("deepseek-v3", LLMLayout(tp=2, ep=2)),  # latent attention's heads split, its latents whole
    ("qwen3-vl-moe", LLMLayout(tp=2, dp=2, etp=2, ep=2)),  # each expert's gate and up columns of one tensor
], ids=["qwen3-moe-tp2-ep2", "qwen3-moe-tp2-dp2-etp2-ep2", "deepseek-v3-tp2-ep2", "qwen3-vl-moe-tp2-dp2-etp2-ep2"])
def test_each_llm_rank_reads_only_its_pieces(checkpoints, family, layout):
    llm = checkpoints / family
    heads = ["llm.n_kv_heads=4"] if family == "deepseek-v3" else []  # the default config's 2: MLA's are all
    overrides = [f"llm.from_hf={llm}", f"data.tokenizer={llm / 'tokenizer.json'}", *heads]
    run_distributed(_pieces_body, layout.world_size, "llm", layout, overrides)


def test_each_encoder_rank_reads_only_its_pieces(checkpoints):
    overrides = [f"encoder.from_hf={checkpoints / 'siglip'}", "encoder.feature_layer=-2", "data.channels=3"]
    run_distributed(_pieces_body, 2, "encoder", EncoderLayout(tp=2), overrides)
