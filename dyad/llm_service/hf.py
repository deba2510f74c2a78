"""Hugging Face MoE decoders' weights under `MoELM`'s names (`llm_sources`: read a rank's piece
at a time; `llm_state_dict`: whole), and back (`hf_tensors`: what `dyad export --to-hf` writes);
their config is `dyad.llm_service.hf_config`'s."""

from __future__ import annotations

import logging

import torch

from dyad.hf_checkpoint import HFCheckpoint
from dyad.llm_service.config import LLMConfig
from dyad.llm_service.hf_config import text_config
from dyad.slices import Merged, Permuted, Source, Split, Stacked, Transposed

log = logging.getLogger(__name__)


def llm_state_dict(checkpoint: HFCheckpoint, cfg: LLMConfig) -> dict[str, torch.Tensor]:
    """`MoELM(cfg)`'s state dict from `checkpoint`, every tensor's name and shape checked."""
    return {name: source.full() for name, source in llm_sources(checkpoint, cfg).items()}


def llm_sources(checkpoint: HFCheckpoint, cfg: LLMConfig) -> dict[str, Source]:
    """Where each tensor of `MoELM(cfg)`'s state dict lies in `checkpoint`, every tensor's name
    and shape checked (nothing read yet)."""
    family = text_config(checkpoint.config)["model_type"]
    decoder, head = _prefixes(checkpoint)
    D = cfg.dim
    skipped = multi_token_prediction_layers(checkpoint, cfg)
    if skipped:
        log.info("%s: skipping layers %s, multi-token prediction's, which the causal LM does not use",
                 checkpoint.path, skipped)

    def get(name: str, *shape: int) -> Source:
        return checkpoint.stored(name, shape)

    state = {
        "tok_embeddings.weight": get(f"{decoder}embed_tokens.weight", cfg.vocab_size, D),
        "norm.weight": get(f"{decoder}norm.weight", D),
        "output.weight": get(f"{head}{_HEAD}", cfg.vocab_size, D),
    }
    for i in range(cfg.n_layers):
        hf, ours = f"{decoder}layers.{i}", f"layers.{i}"
        state[f"{ours}.attn_norm.weight"] = get(f"{hf}.input_layernorm.weight", D)
        state[f"{ours}.ffn_norm.weight"] = get(f"{hf}.post_attention_layernorm.weight", D)
        for mine, theirs, shape in _attention_pairs(cfg):
            state[f"{ours}.attention.{mine}"] = get(f"{hf}.self_attn.{theirs}", *shape)
        if i in cfg.dense_layers:
            H = cfg.dense_ffn_dim
            for mine, theirs, shape in (("w1", "gate_proj", (H, D)), ("w3", "up_proj", (H, D)), ("w2", "down_proj", (D, H))):
                state[f"{ours}.feed_forward.{mine}.weight"] = get(f"{hf}.mlp.{theirs}.weight", *shape)
            continue
        moe, names = _moe_names(family, hf)
        state[f"{ours}.feed_forward.router.weight"] = get(f"{moe}.gate.weight", cfg.moe.num_experts, D)
        if family == "deepseek_v3":  # aux-loss-free balancing's bias, which only selects experts
            state[f"{ours}.feed_forward.expert_bias_E"] = get(f"{moe}.gate.e_score_correction_bias", cfg.moe.num_experts)
        experts = _fused_experts if family in FUSED_EXPERTS else _experts
        state[f"{ours}.feed_forward.w13_ED2F"], state[f"{ours}.feed_forward.w2_EFD"] = experts(checkpoint, moe, names, cfg)
        if cfg.moe.shared_expert_dim:
            H = cfg.moe.shared_expert_dim
            for mine, theirs, shape in (("w1", "gate_proj", (H, D)), ("w3", "up_proj", (H, D)), ("w2", "down_proj", (D, H))):
                state[f"{ours}.feed_forward.shared_expert.{mine}.weight"] = get(f"{moe}.{_shared(family)}.{theirs}.weight", *shape)
        if cfg.moe.shared_expert_gate:
            state[f"{ours}.feed_forward.shared_expert_gate.weight"] = get(f"{moe}.shared_expert_gate.weight", 1, D)
    return state


# Families whose experts are stored fused, every expert's gate and up projections in one tensor
# and their down projections in another.
FUSED_EXPERTS = ("qwen3_vl_moe_text",)


def _experts(checkpoint: HFCheckpoint, moe: str, names: tuple[str, str, str], cfg: LLMConfig) -> tuple[Source, Source]:
    """(w13_ED2F, w2_EFD) of experts stored one by one, their (gate, up, down) projections `names`."""
    D, F = cfg.dim, cfg.moe.expert_dim
    gate, up, down = names
    w13, w2 = [], []
    for e in range(cfg.moe.num_experts):
        expert = f"{moe}.experts.{e}"
        # (gate, up) column pairs interleaved, as `swiglu_pairs` reads them: [D, F, 2] -> [D, 2F]
        pair = [Transposed(checkpoint.stored(f"{expert}.{name}.weight", (F, D))) for name in (gate, up)]
        w13.append(Merged(Stacked(pair, dim=2), dim=1))
        w2.append(Transposed(checkpoint.stored(f"{expert}.{down}.weight", (D, F))))
    return Stacked(w13), Stacked(w2)


def _fused_experts(checkpoint: HFCheckpoint, moe: str, _: tuple[str, str, str], cfg: LLMConfig) -> tuple[Source, Source]:
    """(w13_ED2F, w2_EFD) of fused experts: `experts.gate_up_proj` (each expert's gate rows,
    then its up rows) and `experts.down_proj`, [E, 2F, D] and [E, D, F] as transformers 5 holds
    and saves them, or [E, D, 2F] and [E, F, D] as the hub's checkpoints store them (what has not
    transformers' shape is read transposed, as transformers reads it)."""
    E, D, F = cfg.moe.num_experts, cfg.dim, cfg.moe.expert_dim
    gate_up, down = f"{moe}.experts.gate_up_proj", f"{moe}.experts.down_proj"
    if checkpoint.shape(gate_up) == (E, 2 * F, D):
        pairs_EDF2 = Permuted(Split(checkpoint.stored(gate_up, (E, 2 * F, D)), 1, 2), (0, 3, 2, 1))
    else:
        pairs_EDF2 = Permuted(Split(checkpoint.stored(gate_up, (E, D, 2 * F)), 2, 2), (0, 1, 3, 2))
    if checkpoint.shape(down) == (E, D, F):
        w2_EFD = Permuted(checkpoint.stored(down, (E, D, F)), (0, 2, 1))
    else:
        w2_EFD = checkpoint.stored(down, (E, F, D))
    # (gate, up) column pairs interleaved, as `swiglu_pairs` reads them: [E, D, F, 2] -> [E, D, 2F]
    return Merged(pairs_EDF2, dim=2), w2_EFD


def _prefixes(checkpoint: HFCheckpoint) -> tuple[str, str]:
    """The prefixes of the decoder's tensors and of its output head: ("model.", "") for a causal
    LM, ("language_model.model.", "language_model.") for a LLaVA as transformers saves one."""
    found = []
    for suffix in (_EMBEDDING, _HEAD):
        prefixes = sorted(n.removesuffix(suffix) for n in checkpoint.names if n.endswith(suffix))
        if len(prefixes) != 1:
            raise ValueError(f"{checkpoint.path}: expected one language model ('...{suffix}'), found {len(prefixes)}")
        found.append(prefixes[0])
    return found[0], found[1]


_EMBEDDING, _HEAD = "embed_tokens.weight", "lm_head.weight"


def _attention_pairs(cfg: LLMConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name in `MoELM`'s attention, name in the checkpoint's self_attn, shape) of each tensor."""
    if cfg.attention == "mla":
        return _latent_attention_pairs(cfg)
    D, Dh, H, G = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    projections = (("wq", "q_proj", H * Dh), ("wk", "k_proj", G * Dh), ("wv", "v_proj", G * Dh))
    pairs = [(f"{mine}.weight", f"{theirs}.weight", (rows, D)) for mine, theirs, rows in projections]
    pairs.append(("wo.weight", "o_proj.weight", (D, H * Dh)))
    if cfg.attention_bias:
        pairs += [(f"{mine}.bias", f"{theirs}.bias", (rows,)) for mine, theirs, rows in projections]
    if cfg.qk_norm != "none":  # each head's, or the whole projection's
        per_head = cfg.qk_norm == "head"
        for norm, heads in (("q_norm", H), ("k_norm", G)):
            pairs.append((f"{norm}.weight", f"{norm}.weight", (Dh if per_head else heads * Dh,)))
    return pairs


def _latent_attention_pairs(cfg: LLMConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    mla, D, H = cfg.mla, cfg.dim, cfg.n_heads
    if mla.q_lora_rank:
        query = [
            ("wq_a.weight", "q_a_proj.weight", (mla.q_lora_rank, D)),
            ("q_norm.weight", "q_a_layernorm.weight", (mla.q_lora_rank,)),
            ("wq_b.weight", "q_b_proj.weight", (H * mla.qk_head_dim, mla.q_lora_rank)),
        ]
    else:
        query = [("wq.weight", "q_proj.weight", (H * mla.qk_head_dim, D))]
    return [
        *query,
        ("wkv_a.weight", "kv_a_proj_with_mqa.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, D)),
        ("kv_norm.weight", "kv_a_layernorm.weight", (mla.kv_lora_rank,)),
        ("wkv_b.weight", "kv_b_proj.weight", (H * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)),
        ("wo.weight", "o_proj.weight", (D, H * mla.v_head_dim)),
    ]


def _moe_names(family: str, layer: str) -> tuple[str, tuple[str, str, str]]:
    """The MoE block's prefix and its experts' (gate, up, down) projection names."""
    if family == "mixtral":
        return f"{layer}.block_sparse_moe", ("w1", "w3", "w2")
    return f"{layer}.mlp", ("gate_proj", "up_proj", "down_proj")


def _shared(family: str) -> str:
    """The shared expert's name in the MoE block (DeepSeek-V3's stands for n_shared_experts)."""
    return "shared_experts" if family == "deepseek_v3" else "shared_expert"


def multi_token_prediction_layers(checkpoint: HFCheckpoint, cfg: LLMConfig) -> list[int]:
    """The layers past the decoder's that a DeepSeek-V3 checkpoint carries for multi-token
    prediction (num_nextn_predict_layers): not part of the causal LM, never read."""
    decoder, _ = _prefixes(checkpoint)
    prefix = f"{decoder}layers."
    layers = {int(name.removeprefix(prefix).split(".")[0]) for name in checkpoint.names if name.startswith(prefix)}
    return sorted(i for i in layers if i >= cfg.n_layers)


def hf_tensors(
    state: dict[str, torch.Tensor], cfg: LLMConfig, family: str, *, head: str = "", decoder: str = "model.",
) -> dict[str, torch.Tensor]:
    """`MoELM(cfg)`'s full state dict under `family`'s checkpoint names, each prefixed by `head`
    (a LLaVA's "language_model."), the decoder's by `decoder` too (Qwen3-VL's
    "model.language_model."): the inverse of `llm_state_dict`, each tensor contiguous (what
    safetensors writes); fused experts as transformers 5 saves them."""
    tensors = {
        f"{head}{decoder}embed_tokens.weight": state["tok_embeddings.weight"],
        f"{head}{decoder}norm.weight": state["norm.weight"],
        f"{head}lm_head.weight": state["output.weight"],
    }
    for i in range(cfg.n_layers):
        hf, ours = f"{head}{decoder}layers.{i}", f"layers.{i}"
        tensors[f"{hf}.input_layernorm.weight"] = state[f"{ours}.attn_norm.weight"]
        tensors[f"{hf}.post_attention_layernorm.weight"] = state[f"{ours}.ffn_norm.weight"]
        for mine, theirs, _ in _attention_pairs(cfg):
            tensors[f"{hf}.self_attn.{theirs}"] = state[f"{ours}.attention.{mine}"]
        if i in cfg.dense_layers:
            for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                tensors[f"{hf}.mlp.{theirs}.weight"] = state[f"{ours}.feed_forward.{mine}.weight"]
            continue
        moe, (gate, up, down) = _moe_names(family, hf)
        tensors[f"{moe}.gate.weight"] = state[f"{ours}.feed_forward.router.weight"]
        if family == "deepseek_v3":
            tensors[f"{moe}.gate.e_score_correction_bias"] = state[f"{ours}.feed_forward.expert_bias_E"]
        w13_ED2F, w2_EFD = state[f"{ours}.feed_forward.w13_ED2F"], state[f"{ours}.feed_forward.w2_EFD"]
        if family in FUSED_EXPERTS:  # [E, 2F, D]: each expert's gate rows, then its up rows; [E, D, F]
            tensors[f"{moe}.experts.gate_up_proj"] = torch.cat([w13_ED2F[..., 0::2], w13_ED2F[..., 1::2]], 2).mT
            tensors[f"{moe}.experts.down_proj"] = w2_EFD.mT
        else:
            for e in range(cfg.moe.num_experts):
                tensors[f"{moe}.experts.{e}.{gate}.weight"] = w13_ED2F[e, :, 0::2].T
                tensors[f"{moe}.experts.{e}.{up}.weight"] = w13_ED2F[e, :, 1::2].T
                tensors[f"{moe}.experts.{e}.{down}.weight"] = w2_EFD[e].T
        if cfg.moe.shared_expert_dim:
            for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                tensors[f"{moe}.{_shared(family)}.{theirs}.weight"] = state[f"{ours}.feed_forward.shared_expert.{mine}.weight"]
        if cfg.moe.shared_expert_gate:
            tensors[f"{moe}.shared_expert_gate.weight"] = state[f"{ours}.feed_forward.shared_expert_gate.weight"]
    return {name: tensor.contiguous() for name, tensor in tensors.items()}
