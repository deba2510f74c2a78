"""Hugging Face MoE decoders (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) loaded into dyad's
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
from dyad.llm_service.hf import hf_tensors, llm_state_dict
from dyad.llm_service.hf_config import exported_config, llm_config
from tests.helpers.hf_models import make_norms_and_biases_matter
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


# DeepSeek-V3: latent attention with a query latent, YaRN (its attention factor from both mscales,
# the softmax scale by mscale_all_dim), interleaved rotary pairs, 4 groups of 2 experts of which 2
# are chosen, a group's score its top 2 (not top_k / topk_group = 1), 2 shared experts, the
# first layer dense. The rms_norm_eps is not the latent norms' (1e-6).
DEEPSEEK_V3 = COMMON | {
    "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "intermediate_size": 56, "moe_intermediate_size": 16,
    "n_routed_experts": 8, "n_shared_experts": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
    "routed_scaling_factor": 2.5,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
}


def _deepseek_v3(**changes):
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_V3 | changes))
    with torch.no_grad():  # routers that tell experts apart; biases that change the choice
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(std=0.5)
    return model


def _deepseek_v3_plain():
    """The other branches: one query projection, the default rotary in halves, one group."""
    return _deepseek_v3(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                        rope_parameters={"rope_type": "default", "rope_theta": 500.0})


FAMILIES = {
    "mixtral": _mixtral, "olmoe": _olmoe, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3, "deepseek_v3-plain": _deepseek_v3_plain,
}


def _saved(build, path):
    torch.manual_seed(0)
    model = build().float().eval()
    make_norms_and_biases_matter(model, bias_std=0.5)
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
    assert set(named) == set(grads) - {name for name, _ in ours.model.named_buffers()}
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


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
         "mscale_all_dim": 0.8},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3's
        {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 8, "beta_slow": 2, "truncate": False},
        {"factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 1.3},
    ],
)
def test_yarn_frequencies_and_scales_are_transformers_bit_for_bit(rope, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from dyad.llm_service.model import mla_softmax_scale
    from dyad.llm_service.rotary import rotary_frequencies

    config = transformers.DeepseekV3Config(
        **DEEPSEEK_V3 | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, **rope}, "qk_rope_head_dim": 16}
    )
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    config.save_pretrained(tmp_path)
    cfg = llm_config(json.loads((tmp_path / "config.json").read_text()))
    inv_freq, factor = rotary_frequencies(cfg, torch.device("cpu"))
    assert torch.equal(inv_freq, expected_inv_freq) and factor == expected_factor
    assert mla_softmax_scale(cfg) == yarn_apply_mscale(config.rope_parameters, config.qk_head_dim ** -0.5)


def test_deepseek_v3_shapes_come_from_its_config(tmp_path):
    _saved(_deepseek_v3, tmp_path)
    cfg = llm_config(json.loads((tmp_path / "config.json").read_text()))
    assert (cfg.attention, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim) == ("mla", 4, 12, 4)
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.v_head_dim, cfg.mla.rope_interleave) == (24, 16, 6, True)
    assert (cfg.rope_type, cfg.yarn.factor, cfg.yarn.original_max_seq_len, cfg.yarn.mscale_all_dim) == ("yarn", 4.0, 16, 0.8)
    assert cfg.dense_layers == (0,) and cfg.dense_ffn_dim == 56
    moe = cfg.moe
    assert (moe.score_func, moe.expert_bias, moe.n_groups, moe.topk_groups, moe.group_score_experts) == ("sigmoid", True, 4, 2, 2)
    assert (moe.shared_expert_dim, moe.routed_scaling_factor, moe.aux_loss_coef) == (32, 2.5, 0.0)


def test_deepseek_v3_multi_token_prediction_layers_are_skipped_and_said(tmp_path, caplog):
    reference = _saved(_deepseek_v3, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    mtp = {name.replace("layers.2.", "layers.3."): t.clone() for name, t in weights.items() if ".layers.2." in name}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)  # MTP's own parts are not a decoder layer's
    save_file(weights | mtp, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="dyad.llm_service.hf"):
        ours = dyad.hf.load(tmp_path)
    assert "skipping layers [3], multi-token prediction's" in caplog.text
    input_ids, attention_mask, _ = _batch()
    real = attention_mask.bool()
    expected = reference(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(ours(input_ids, attention_mask=attention_mask).logits[real], expected[real], **TOL)


@pytest.mark.parametrize(
    "field, value",
    [("num_key_value_heads", 2), ("quantization_config", {"quant_method": "fp8"}), ("moe_layer_freq", 2),
     ("scoring_func", "softmax"), ("topk_method", "greedy"), ("attention_bias", True)],
)
def test_a_deepseek_v3_config_dyad_does_not_model_is_refused_naming_the_field(field, value, tmp_path):
    _saved(_deepseek_v3, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(ValueError, match=f"config.json {field}="):
        dyad.hf.load(tmp_path)


def test_a_rotary_scaling_other_than_deepseek_v3_yarn_is_refused(tmp_path):
    _saved(_deepseek_v3, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}))
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        dyad.hf.load(tmp_path)
    _saved(_qwen3_moe, tmp_path)  # the other families: the default rotary only, also in transformers 4's spelling
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    legacy = {"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(config | legacy))
    with pytest.raises(ValueError, match="rope_type 'yarn': dyad loads the default rotary embedding only"):
        dyad.hf.load(tmp_path)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["llm.attention=flash"], r"llm.attention \('flash'\) must be one of gqa, mla"),
        (["llm.attention=mla"], r"llm.n_kv_heads \(2\) must equal llm.n_heads \(4\) with llm.attention 'mla'"),
        (["llm.attention=mla", "llm.n_kv_heads=4", "llm.head_dim=8"], r"llm.head_dim \(8\) must be 0 or .* \(24\)"),
        (["llm.attention=mla", "llm.n_kv_heads=4", "llm.qk_norm=head"],
         r"llm.qk_norm \('head'\) is not an option of llm.attention 'mla'"),
        (["llm.mla.qk_rope_head_dim=5"], r"llm.mla.qk_rope_head_dim \(5\) must be even"),
        (["llm.mla.kv_lora_rank=0"], r"llm.mla.kv_lora_rank \(0\) must be >= 1"),
        (["llm.mla.q_lora_rank=-1"], r"llm.mla.q_lora_rank \(-1\) must be >= 0"),
        (["llm.rope_type=ntk"], r"llm.rope_type \('ntk'\) must be one of default, yarn"),
        (["llm.rope_type=yarn"], r"llm.yarn.original_max_seq_len \(0\) must be >= 1 with llm.rope_type 'yarn'"),
        (["llm.yarn.factor=0.5"], r"llm.yarn.factor \(0.5\) must be >= 1"),
        (["llm.yarn.beta_fast=1.0", "llm.yarn.beta_slow=2.0"],
         r"llm.yarn.beta_fast \(1.0\) must be > llm.yarn.beta_slow \(2.0\) > 0"),
        (["llm.yarn.mscale_all_dim=-1.0"], r"llm.yarn.mscale_all_dim \(-1.0\) must be >= 0"),
        (["llm.moe.routed_scaling_factor=0.0"], r"llm.moe.routed_scaling_factor \(0.0\) must be > 0"),
        (["llm.moe.num_experts=8", "llm.moe.n_groups=4", "llm.moe.group_score_experts=3"],
         r"llm.moe.group_score_experts \(3\) must be in \[0, .* \(2\)\]"),
        (["llm.moe.num_experts=8", "llm.moe.top_k=5", "llm.moe.n_groups=4", "llm.moe.topk_groups=2",
          "llm.moe.group_score_experts=2"], r"llm.moe.top_k \(5\) must be <= llm.moe.topk_groups x the experts per group \(4\)"),
    ],
)
def test_invalid_latent_attention_yarn_and_routing_fields_are_named(overrides, match):
    from dyad import config as config_lib

    with pytest.raises(ValueError, match=match):
        config_lib.load(None, overrides)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_export_loads_in_transformers_with_dyad_logits(family, tmp_path):
    """`hf_tensors` and `exported_config`, what `dyad export --to-hf` writes, of a model whose
    every parameter (and expert bias) moved away from the checkpoint's."""
    _saved(FAMILIES[family], tmp_path / "model")
    ours = dyad.hf.load(tmp_path / "model")
    with torch.no_grad():
        for tensor in [*ours.model.parameters(), *ours.model.buffers()]:
            if tensor.is_floating_point():
                tensor.add_(torch.randn_like(tensor), alpha=0.05)
    source = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "out").mkdir()
    save_file(hf_tensors(ours.model.state_dict(), ours.model.cfg, source["model_type"]),
              tmp_path / "out" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "out" / "config.json").write_text(json.dumps(exported_config(source, ours.model.cfg)))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    input_ids, attention_mask, _ = _batch()
    real = attention_mask.bool()
    with torch.no_grad():
        expected = ours(input_ids, attention_mask=attention_mask).logits
        got = exported(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(got[real], expected[real], **TOL)
