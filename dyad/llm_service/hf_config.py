"""What a Hugging Face MoE decoder's `config.json` says, as dyad's LLM config (torch-free: the
router and the CLI check a run's `llm.from_hf` without the model code).

Families: Mixtral (`MixtralForCausalLM`), Qwen3-MoE (`Qwen3MoeForCausalLM`: per-head q/k norm,
its own head_dim, dense layers by `mlp_only_layers` / `decoder_sparse_step`) and Qwen2-MoE
(`Qwen2MoeForCausalLM`: q/k/v biases, a shared expert behind a sigmoid gate, dense layers as
Qwen3-MoE's), OLMoE (`OlmoeForCausalLM`: q/k norms over the whole projection) and DeepSeek-V3
(`DeepseekV3ForCausalLM`: multi-head latent attention, YaRN, sigmoid routing over groups with
a correction bias and a routed scaling factor, shared experts, the first k layers dense; the
multi-token-prediction layers are not loaded). A config field that would change the math in a
way `MoELM` does not model (a sliding window, attention biases, tied embeddings, a scaled rotary
embedding other than DeepSeek-V3's YaRN, another activation, quantized weights) is a ValueError
naming it: a model is loaded exactly or not at all. Any of them loads as the language model of a
LLaVA (`LlavaForConditionalGeneration`: its `text_config`). Qwen3-VL-MoE's language model
(`Qwen3VLMoeForConditionalGeneration`'s `text_config`, model_type `qwen3_vl_moe_text`) is
Qwen3-MoE's decoder with multimodal rotary positions (`mrope_section`, interleaved whatever
`mrope_interleaved` says, as transformers' class does) and top-k weights always renormalised;
the dense Qwen3-VL's (`Qwen3VLForConditionalGeneration`'s `text_config`, model_type
`qwen3_vl_text`) is the same decoder with a SwiGLU in every layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dyad.hf_checkpoint import QWEN3_VL_DEEPSTACK_INDEXES, adopted, read_config
from dyad.llm_service.config import LLMConfig, MLAConfig, MoEConfig, YarnConfig

FAMILIES = ("deepseek_v3", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "qwen3_vl_moe_text", "qwen3_vl_text")
QWEN3_VL_TEXT = ("qwen3_vl_moe_text", "qwen3_vl_text")  # multimodal rotary positions
QWEN3_VL = ("qwen3_vl_moe", "qwen3_vl")  # their whole models: the head is theirs, tied or not
# Whole models whose config.json holds the language model's as `text_config`.
MULTIMODAL = ("llava", *QWEN3_VL)
# transformers' default where a Qwen3-VL config names no mrope_section
QWEN3_VL_MROPE_SECTION = (24, 20, 20)


def text_config(hf: dict) -> dict:
    """The language model's part of a config.json: itself, or a multimodal model's `text_config`."""
    return hf["text_config"] if hf.get("model_type") in MULTIMODAL else hf


def llm_config(hf: dict, *, max_seq_len: int | None = None) -> LLMConfig:
    """dyad's LLM config for a Hugging Face `config.json` of one of `FAMILIES` (or of a
    `MULTIMODAL` model of one)."""
    text = text_config(hf)
    deepstack_levels = 0
    if hf.get("model_type") in QWEN3_VL:  # the head is the whole model's, tied or not by its config
        text = text | {"tie_word_embeddings": hf.get("tie_word_embeddings", False)}
        deepstack_levels = len(hf.get("vision_config", {}).get("deepstack_visual_indexes", QWEN3_VL_DEEPSTACK_INDEXES))
    hf = text
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"config.json model_type {family!r} is not an LLM family dyad loads ({', '.join(FAMILIES)})")
    _refuse(hf, family)
    if family == "deepseek_v3":
        return _deepseek_v3(hf, max_seq_len)
    n_layers = hf["num_hidden_layers"]
    dense_layers, dense_ffn_dim, moe = _feed_forward(hf, family, n_layers)
    return LLMConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 0,
        qk_norm="head" if family in ("qwen3_moe", *QWEN3_VL_TEXT) else "projection" if family == "olmoe" else "none",
        attention_bias=family == "qwen2_moe" and hf.get("qkv_bias", True),
        pad_token_id=-1 if hf.get("pad_token_id") is None else hf["pad_token_id"],
        rope_theta=_rope_theta(hf),
        mrope_section=_mrope_section(hf) if family in QWEN3_VL_TEXT else (),
        deepstack_levels=deepstack_levels,
        norm_eps=hf["rms_norm_eps"],
        dense_ffn_dim=dense_ffn_dim,
        dense_layers=dense_layers,
        max_seq_len=max_seq_len or hf["max_position_embeddings"],
        moe=moe,
    )


def _feed_forward(hf: dict, family: str, n_layers: int) -> tuple[tuple[int, ...], int, MoEConfig]:
    """(the dense layers, their SwiGLU's hidden dim, the MoE layers' config) of a family but DeepSeek-V3."""
    if family == "qwen3_vl_text":  # dense: a SwiGLU in every layer, the MoE section unused
        return tuple(range(n_layers)), hf["intermediate_size"], MoEConfig()
    shared = hf.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
    if family == "mixtral":
        experts, expert_dim, dense_layers = hf["num_local_experts"], hf["intermediate_size"], ()
        dense_ffn_dim, norm_topk = hf["intermediate_size"], True
    elif family == "olmoe":
        experts, expert_dim, dense_layers = hf.get("num_experts", hf.get("num_local_experts")), hf["intermediate_size"], ()
        dense_ffn_dim, norm_topk = hf["intermediate_size"], hf.get("norm_topk_prob", False)
    else:
        # The hub's checkpoints say num_experts; transformers 5 writes num_local_experts.
        experts, expert_dim = hf.get("num_experts", hf.get("num_local_experts")), hf["moe_intermediate_size"]
        dense_ffn_dim, norm_topk = hf["intermediate_size"], hf.get("norm_topk_prob", True)
        if family == "qwen3_vl_moe_text":  # its router renormalises, whatever norm_topk_prob says
            norm_topk = True
        sparse_step, dense_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        dense_layers = tuple(
            i for i in range(n_layers) if i in dense_only or experts == 0 or (i + 1) % sparse_step != 0
        )
    return dense_layers, dense_ffn_dim, MoEConfig(
        num_experts=experts,
        top_k=hf["num_experts_per_tok"],
        expert_dim=expert_dim,
        shared_expert_dim=shared,
        shared_expert_gate=shared > 0,
        norm_topk_prob=norm_topk,
        score_func="softmax",
        # dyad's balance loss is per layer, transformers' over all layers at once: a loaded
        # model trains with dyad's, at the checkpoint's coefficient.
        aux_loss_coef=hf.get("router_aux_loss_coef", 0.0),
    )


def _deepseek_v3(hf: dict, max_seq_len: int | None) -> LLMConfig:
    n_layers, experts, expert_dim = hf["num_hidden_layers"], hf["n_routed_experts"], hf["moe_intermediate_size"]
    rope = _rope_parameters(hf)
    kind = _rope_type(rope)
    if kind not in ("default", "yarn"):
        raise ValueError(f"config.json rope_type {kind!r}: dyad loads DeepSeek-V3's default or YaRN rotary embedding")
    return LLMConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_attention_heads"],
        attention="mla",
        mla=MLAConfig(
            q_lora_rank=hf.get("q_lora_rank") or 0,
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_interleave=hf.get("rope_interleave", True),
        ),
        pad_token_id=-1 if hf.get("pad_token_id") is None else hf["pad_token_id"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_type=kind,
        yarn=_yarn(hf, rope) if kind == "yarn" else YarnConfig(),
        norm_eps=hf["rms_norm_eps"],
        dense_ffn_dim=hf["intermediate_size"],
        dense_layers=tuple(range(min(hf.get("first_k_dense_replace") or 0, n_layers))),
        max_seq_len=max_seq_len or hf["max_position_embeddings"],
        moe=MoEConfig(
            num_experts=experts,
            top_k=hf["num_experts_per_tok"],
            expert_dim=expert_dim,
            shared_expert_dim=(hf.get("n_shared_experts") or 0) * expert_dim,
            norm_topk_prob=hf.get("norm_topk_prob", True),
            score_func="sigmoid",
            expert_bias=True,  # e_score_correction_bias
            n_groups=hf.get("n_group") or 1,
            topk_groups=hf.get("topk_group") or 1,
            group_score_experts=2,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            aux_loss_coef=0.0,  # balanced by the bias; transformers computes no balance loss
        ),
    )


def _rope_parameters(hf: dict) -> dict:
    """The rotary section: transformers 5's rope_parameters, or 4's rope_scaling (rope_theta at the top)."""
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_type(rope: dict) -> str:
    return rope.get("rope_type") or rope.get("type") or "default"  # "type": older configs' name


def _yarn(hf: dict, rope: dict) -> YarnConfig:
    """YaRN's parameters as transformers reads them (`standardize_rope_params`, `_compute_yarn_parameters`)."""
    original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    original = original or hf["max_position_embeddings"]
    return YarnConfig(
        factor=float(rope.get("factor") or hf["max_position_embeddings"] / original),
        original_max_seq_len=original,
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
        attention_factor=float(rope.get("attention_factor") or 0),
        truncate=rope.get("truncate", True),
    )


def _rope_theta(hf: dict) -> float:
    rope = _rope_parameters(hf)
    kind = _rope_type(rope)
    if kind != "default":
        raise ValueError(f"config.json rope_type {kind!r}: dyad loads the default rotary embedding only")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _mrope_section(hf: dict) -> tuple[int, ...]:
    return tuple(_rope_parameters(hf).get("mrope_section") or QWEN3_VL_MROPE_SECTION)


def _refuse(hf: dict, family: str) -> None:
    """ValueError naming the first config.json field whose value `MoELM` does not model."""
    checks: list[tuple[str, Callable[[object], bool]]] = [
        ("hidden_act", lambda v: v in (None, "silu")),
        ("attention_bias", lambda v: not v),
        ("tie_word_embeddings", lambda v: not v),
        # Qwen's configs carry a window that only use_sliding_window turns on.
        ("sliding_window", lambda v: not v or ("use_sliding_window" in hf and not hf["use_sliding_window"])),
        ("use_sliding_window", lambda v: not v),
        ("clip_qkv", lambda v: v is None),
        ("quantization_config", lambda v: not v),  # e.g. DeepSeek-V3's float8 blocks and their scales
    ]
    if family == "deepseek_v3":
        checks += [
            # transformers' MLA repeats its keys and values by heads / num_key_value_heads
            ("num_key_value_heads", lambda v: v in (None, hf["num_attention_heads"])),
            ("moe_layer_freq", lambda v: v in (None, 1)),
            ("scoring_func", lambda v: v in (None, "sigmoid")),
            ("topk_method", lambda v: v in (None, "noaux_tc")),
        ]
    for field, supported in checks:
        if field in hf and not supported(hf[field]):
            raise ValueError(f"config.json {field}={hf[field]!r} is not supported for {family}")


# What a checkpoint fixes: a run's llm section may repeat these, never contradict them.
ARCHITECTURE = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "qk_norm", "attention_bias", "pad_token_id", "rope_theta",
    "mrope_section", "deepstack_levels", "norm_eps",
    "dense_ffn_dim", "dense_layers", "attention", "mla", "rope_type", "yarn",
)
MOE_ARCHITECTURE = ("num_experts", "top_k", "expert_dim", "shared_expert_dim", "shared_expert_gate", "norm_topk_prob",
                    "score_func", "topk_before_softmax", "n_groups", "topk_groups", "group_score_experts",
                    "routed_scaling_factor")


def pretrained(llm: LLMConfig, vocab_size: int) -> LLMConfig:
    """`llm` with the architecture of its `from_hf` checkpoint; the other fields (dispatcher,
    capacity, float8, ...) stay the run's, and a field the run set away from its default to
    something else than the checkpoint's is a ValueError naming both. The vocabulary is the
    checkpoint's, grown to the tokenizer's where the tokenizer has more ids (`vocabulary_growth`)."""
    hf = read_config(llm.from_hf, "llm.from_hf")
    try:
        derived = llm_config(hf)
    except (KeyError, TypeError) as error:
        raise ValueError(f"llm.from_hf: {llm.from_hf}/config.json lacks or misstates {error}") from None
    source, default, default_moe = "llm.from_hf's checkpoint", LLMConfig(), MoEConfig()
    moe = dataclasses.replace(
        llm.moe, **adopted(llm.moe, derived.moe, MOE_ARCHITECTURE, section="llm.moe", source=source),
        # A checkpoint's correction bias is loaded (DeepSeek-V3); a run may add one to any family.
        expert_bias=llm.moe.expert_bias or derived.moe.expert_bias,
        aux_loss_coef=llm.moe.aux_loss_coef if llm.moe.aux_loss_coef != default_moe.aux_loss_coef
        else derived.moe.aux_loss_coef,
    )
    return dataclasses.replace(
        llm, **adopted(llm, derived, ARCHITECTURE, section="llm", source=source), moe=moe,
        vocab_size=max(vocab_size, derived.vocab_size),
        max_seq_len=llm.max_seq_len if llm.max_seq_len != default.max_seq_len else derived.max_seq_len,
    )


def exported_config(source: dict, llm: LLMConfig) -> dict:
    """The config.json of a model exported from a run that started from `source`: the run's
    vocabulary, and no multi-token-prediction layers (DeepSeek-V3's are not loaded, so not
    written)."""
    exported = source | {"vocab_size": llm.vocab_size}
    if "num_nextn_predict_layers" in source:
        exported["num_nextn_predict_layers"] = 0
    return exported


def vocabulary_growth(llm: LLMConfig) -> str | None:
    """What a run says when its tokenizer has more ids than the checkpoint's embedding rows."""
    if not llm.from_hf:
        return None
    rows = text_config(read_config(llm.from_hf, "llm.from_hf"))["vocab_size"]
    if llm.vocab_size <= rows:
        return None
    return (
        f"the tokenizer has {llm.vocab_size - rows} more ids than {llm.from_hf}'s embedding ({rows} rows): "
        f"the LLM's embedding and output grow to {llm.vocab_size} rows, the new ones initialised by the run's seed"
    )
