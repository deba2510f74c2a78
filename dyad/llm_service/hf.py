"""Hugging Face MoE decoders as `MoELM`: the config of a `config.json` (`llm_config`) and the
weights of its safetensors files under dyad's names (`llm_state_dict`).

Families: Mixtral (`MixtralForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`: per-head q/k norm,
its own head_dim, dense layers by `mlp_only_layers` / `decoder_sparse_step`). A config field
that would change the math in a way `MoELM` does not model (a sliding window, attention biases,
tied embeddings, a scaled rotary embedding, another activation) is a ValueError naming it: a
model is loaded exactly or not at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dyad.hf_checkpoint import HFCheckpoint
from dyad.llm_service.config import LLMConfig, MoEConfig

FAMILIES = ("mixtral", "qwen3_moe")


def llm_config(hf: dict, *, max_seq_len: int | None = None) -> LLMConfig:
    """dyad's LLM config for a Hugging Face `config.json` of one of `FAMILIES`."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"config.json model_type {family!r} is not an LLM family dyad loads ({', '.join(FAMILIES)})")
    _refuse(hf, family)
    n_layers = hf["num_hidden_layers"]
    if family == "mixtral":
        experts, expert_dim, dense_layers = hf["num_local_experts"], hf["intermediate_size"], ()
        dense_ffn_dim, norm_topk = hf["intermediate_size"], True
    else:
        # The hub's checkpoints say num_experts; transformers 5 writes num_local_experts.
        experts, expert_dim = hf.get("num_experts", hf.get("num_local_experts")), hf["moe_intermediate_size"]
        dense_ffn_dim, norm_topk = hf["intermediate_size"], hf.get("norm_topk_prob", True)
        sparse_step, dense_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        dense_layers = tuple(
            i for i in range(n_layers) if i in dense_only or experts == 0 or (i + 1) % sparse_step != 0
        )
    return LLMConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 0,
        qk_norm=family == "qwen3_moe",
        rope_theta=_rope_theta(hf),
        norm_eps=hf["rms_norm_eps"],
        dense_ffn_dim=dense_ffn_dim,
        dense_layers=dense_layers,
        max_seq_len=max_seq_len or hf["max_position_embeddings"],
        moe=MoEConfig(
            num_experts=experts,
            top_k=hf["num_experts_per_tok"],
            expert_dim=expert_dim,
            norm_topk_prob=norm_topk,
            score_func="softmax",
            # dyad's balance loss is per layer, transformers' over all layers at once: a loaded
            # model trains with dyad's, at the checkpoint's coefficient.
            aux_loss_coef=hf.get("router_aux_loss_coef", 0.0),
        ),
    )


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or {}  # transformers 5; 4 kept rope_theta at the top
    kind = rope.get("rope_type") or (hf.get("rope_scaling") or {}).get("rope_type") or "default"
    if kind != "default":
        raise ValueError(f"config.json rope_type {kind!r}: dyad loads the default rotary embedding only")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _refuse(hf: dict, family: str) -> None:
    """ValueError naming the first config.json field whose value `MoELM` does not model."""
    checks: list[tuple[str, Callable[[object], bool]]] = [
        ("hidden_act", lambda v: v in (None, "silu")),
        ("attention_bias", lambda v: not v),
        ("tie_word_embeddings", lambda v: not v),
        ("sliding_window", lambda v: v is None or family == "qwen3_moe" and not hf.get("use_sliding_window")),
        ("use_sliding_window", lambda v: not v),
        ("shared_expert_intermediate_size", lambda v: not v),
    ]
    for field, supported in checks:
        if field in hf and not supported(hf[field]):
            raise ValueError(f"config.json {field}={hf[field]!r} is not supported for {family}")


def llm_state_dict(checkpoint: HFCheckpoint, cfg: LLMConfig) -> dict[str, torch.Tensor]:
    """`MoELM(cfg)`'s state dict from `checkpoint`, every tensor's name and shape checked."""
    family = checkpoint.config["model_type"]
    D, Dh, F = cfg.dim, cfg.head_dim, cfg.moe.expert_dim

    def get(name: str, *shape: int) -> torch.Tensor:
        return checkpoint.tensor(name, shape)

    state = {
        "tok_embeddings.weight": get("model.embed_tokens.weight", cfg.vocab_size, D),
        "norm.weight": get("model.norm.weight", D),
        "output.weight": get("lm_head.weight", cfg.vocab_size, D),
    }
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        state[f"{ours}.attn_norm.weight"] = get(f"{hf}.input_layernorm.weight", D)
        state[f"{ours}.ffn_norm.weight"] = get(f"{hf}.post_attention_layernorm.weight", D)
        for mine, theirs, rows in (
            ("wq", "q_proj", cfg.n_heads * Dh), ("wk", "k_proj", cfg.n_kv_heads * Dh), ("wv", "v_proj", cfg.n_kv_heads * Dh),
        ):
            state[f"{ours}.attention.{mine}.weight"] = get(f"{hf}.self_attn.{theirs}.weight", rows, D)
        state[f"{ours}.attention.wo.weight"] = get(f"{hf}.self_attn.o_proj.weight", D, cfg.n_heads * Dh)
        if cfg.qk_norm:
            state[f"{ours}.attention.q_norm.weight"] = get(f"{hf}.self_attn.q_norm.weight", Dh)
            state[f"{ours}.attention.k_norm.weight"] = get(f"{hf}.self_attn.k_norm.weight", Dh)
        if i in cfg.dense_layers:
            H = cfg.dense_ffn_dim
            for mine, theirs, shape in (("w1", "gate_proj", (H, D)), ("w3", "up_proj", (H, D)), ("w2", "down_proj", (D, H))):
                state[f"{ours}.feed_forward.{mine}.weight"] = get(f"{hf}.mlp.{theirs}.weight", *shape)
            continue
        moe, (gate, up, down) = _moe_names(family, hf)
        state[f"{ours}.feed_forward.router.weight"] = get(f"{moe}.gate.weight", cfg.moe.num_experts, D)
        w13, w2 = [], []
        for e in range(cfg.moe.num_experts):
            expert = f"{moe}.experts.{e}"
            # (gate, up) column pairs interleaved, as `swiglu_pairs` reads them
            w13.append(torch.stack([get(f"{expert}.{gate}.weight", F, D).T, get(f"{expert}.{up}.weight", F, D).T], -1))
            w2.append(get(f"{expert}.{down}.weight", D, F).T)
        state[f"{ours}.feed_forward.w13_ED2F"] = torch.stack(w13).reshape(cfg.moe.num_experts, D, 2 * F)
        state[f"{ours}.feed_forward.w2_EFD"] = torch.stack(w2)
    return state


def _moe_names(family: str, layer: str) -> tuple[str, tuple[str, str, str]]:
    """The MoE block's prefix and its experts' (gate, up, down) projection names."""
    if family == "mixtral":
        return f"{layer}.block_sparse_moe", ("w1", "w3", "w2")
    return f"{layer}.mlp", ("gate_proj", "up_proj", "down_proj")
