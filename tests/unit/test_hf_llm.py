"""Hugging Face MoE decoders (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE) loaded into dyad's
single-device model (`dyad.hf.load`): tiny random models built and saved with transformers, the
same inputs through both, logits, loss and every parameter's gradient equal in float32 (1e-5
relative; each gradient in the max norm, as the layout tests compare them). A tensor missing from the checkpoint, or of the wrong
shape, or a config field dyad does not model, is an error naming it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dyad.hf
from dyad.hf_checkpoint import HFCheckpoint
from dyad.llm_service.hf import llm_state_dict
from dyad.llm_service.hf_config import llm_config
from tests.helpers.parity import relative_error

transformers = pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e '.[test]')")

TOL = dict(rtol=1e-5, atol=1e-6)
COMMON = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-6, num_experts_per_tok=2, tie_word_embeddings=False,
)


def _mixtral():
    config = transformers.MixtralConfig(**COMMON, intermediate_size=40, num_local_experts=4, router_aux_loss_coef=0.0)
    return transformers.MixtralForCausalLM(config)


def _qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        **COMMON, head_dim=12, intermediate_size=56, moe_intermediate_size=24, num_experts=6,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True, router_aux_loss_coef=0.0,
    )
    return transformers.Qwen3MoeForCausalLM(config)


def _qwen2_moe():
    config = transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=56, moe_intermediate_size=24, shared_expert_intermediate_size=20,
        num_experts=6, decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=False, router_aux_loss_coef=0.0,
    )
    return transformers.Qwen2MoeForCausalLM(config)


def _olmoe():
    config = transformers.OlmoeConfig(
        **COMMON, intermediate_size=24, num_experts=6, norm_topk_prob=False, router_aux_loss_coef=0.0,
        pad_token_id=0, eos_token_id=1,
    )
    return transformers.OlmoeForCausalLM(config)


FAMILIES = {"mixtral": _mixtral, "olmoe": _olmoe, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe}


def _saved(build, path):
    torch.manual_seed(0)
    model = build().float().eval()
    with torch.no_grad():  # norms start at one and biases at zero: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(std=0.5)
    model.save_pretrained(path)
    return model


def _batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0  # right padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_match_transformers(family, tmp_path):
    reference = _saved(FAMILIES[family], tmp_path / "model")
    ours = dyad.hf.load(tmp_path / "model")
    input_ids, attention_mask, labels = _batch()

    expected = reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    expected.loss.backward()
    got = ours(input_ids, attention_mask=attention_mask, labels=labels)
    got.loss.backward()

    real = attention_mask.bool()  # padding's own logits are nobody's business
    torch.testing.assert_close(got.logits[real], expected.logits[real], **TOL)
    torch.testing.assert_close(got.loss, expected.loss, **TOL)

    # transformers' gradients, written as a checkpoint by its own save_pretrained (its on-disk
    # names), read back under dyad's names: every parameter's gradient, compared.
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.grad)
    reference.save_pretrained(tmp_path / "grads")
    grads = llm_state_dict(HFCheckpoint(tmp_path / "grads"), ours.model.cfg)
    named = dict(ours.model.named_parameters())
    assert set(named) == set(grads)
    for name, param in named.items():  # in the max norm, as the layout tests (tests/helpers/parity.py)
        error = relative_error(param.grad, grads[name], "max")
        assert error <= 1e-5, f"{name}: relative error {error:.2e} (max norm)"


def test_qwen3_moe_layers_and_head_dim_come_from_its_config(tmp_path):
    _saved(_qwen3_moe, tmp_path)
    cfg = llm_config(json.loads((tmp_path / "config.json").read_text()))
    assert (cfg.head_dim, cfg.dim // cfg.n_heads) == (12, 8)  # decoupled from dim / heads
    assert cfg.qk_norm == "head" and cfg.dense_layers == (1,) and cfg.dense_ffn_dim == 56 and cfg.moe.expert_dim == 24


def test_a_missing_or_misshapen_tensor_is_named(tmp_path):
    _saved(_mixtral, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    save_file({k: v for k, v in weights.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"has no tensor '{name}'"):
        dyad.hf.load(tmp_path)
    weights[name] = weights[name][:, :-1].contiguous()
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \[40, 31\], the model needs \[40, 32\]"):
        dyad.hf.load(tmp_path)


def test_a_config_dyad_does_not_model_is_refused_naming_the_field(tmp_path):
    _saved(_mixtral, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for field, value in (("sliding_window", 16), ("tie_word_embeddings", True), ("hidden_act", "gelu")):
        (tmp_path / "config.json").write_text(json.dumps(config | {field: value}))
        with pytest.raises(ValueError, match=f"config.json {field}="):
            dyad.hf.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama' is not one dyad loads"):
        dyad.hf.load(tmp_path)
    with pytest.raises(ValueError, match="has no config.json"):
        dyad.hf.load(tmp_path / "nowhere")
