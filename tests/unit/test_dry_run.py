"""`dyad train --dry-run` over the configs dyad ships, pointed at model directories that hold only
a config.json written by transformers' config classes at the real models' dimensions (and a
stand-in tokenizer): the parameters it prints are transformers' count of the same parts, built on
the meta device; the memory of one rank is checked by hand; nothing starts."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from dyad.app.cli import main
from dyad.data.digits import VOCABULARY_TEXTS
from dyad.data.tokenizer import build_word_tokenizer

# The models' config.json values (Hugging Face: Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1,
# google/siglip2-so400m-patch16-384's vision_config, openai/clip-vit-large-patch14-336's vision_config).
QWEN3_30B_A3B = {
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "intermediate_size": 6144, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
}
MIXTRAL_8X7B = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
    "max_position_embeddings": 32768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.02,
    "tie_word_embeddings": False,
}
SIGLIP2_SO400M_384 = {
    "hidden_size": 1152, "num_hidden_layers": 27, "num_attention_heads": 16, "intermediate_size": 4304,
    "patch_size": 16, "image_size": 384, "num_channels": 3, "hidden_act": "gelu_pytorch_tanh",
}
CLIP_L_336 = {
    "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
    "patch_size": 14, "image_size": 336, "num_channels": 3, "hidden_act": "quick_gelu", "projection_dim": 768,
}

PAIRS = {
    "qwen3-30b-a3b-siglip2": (transformers.Qwen3MoeConfig(**QWEN3_30B_A3B),
                              transformers.SiglipVisionConfig(**SIGLIP2_SO400M_384)),
    "mixtral-8x7b-clip-l336": (transformers.MixtralConfig(**MIXTRAL_8X7B),
                               transformers.CLIPVisionConfig(**CLIP_L_336)),
}
# What the model cards say, in billions: (LLM total, LLM active per token, vision tower)
KNOWN_SIZES = {"qwen3-30b-a3b-siglip2": (30.5, 3.3, 0.4), "mixtral-8x7b-clip-l336": (46.7, 12.9, 0.3)}
CONFIGS = [f"{pair}-{gpus}gpu" for pair in PAIRS for gpus in (8, 16)]


def model_dirs(tmp_path, pair: str) -> list[str]:
    """--set overrides pointing the config at config.json-only directories of the real shapes."""
    llm_config, vision_config = PAIRS[pair]
    llm_config.save_pretrained(tmp_path / "llm")
    vision_config.save_pretrained(tmp_path / "vision")
    build_word_tokenizer(VOCABULARY_TEXTS).save(tmp_path / "tokenizer.json")  # its ids stay below the LLM's rows
    return [f"llm.from_hf={tmp_path / 'llm'}", f"encoder.from_hf={tmp_path / 'vision'}",
            f"data.tokenizer={tmp_path / 'tokenizer.json'}"]


def dry_run(capsys, config: str, overrides: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["train", "--config", config, "--dry-run", *[a for o in overrides for a in ("--set", o)]])
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    return out


def printed(out: str, pool: str, what: str) -> int:
    """A number the dry run printed on its `pool` line, before `what`."""
    line = next(line for line in out.splitlines() if line.startswith(f"  {pool} ") and what in line)
    return int(re.search(rf"([\d,]+) {what}", line).group(1).replace(",", ""))


def meta_numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def transformers_llm(config) -> tuple[int, int]:
    """(total, per token) of transformers' model: the experts count top_k / num_experts per token."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    total = meta_numel(model)
    return total, total - experts + experts * config.num_experts_per_tok // _experts(config)


def _experts(config) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


def transformers_tower(config, depth: int) -> int:
    """transformers' vision tower as dyad feeds it to the LLM: the embeddings (and CLIP's norm
    before the first block) and the first `depth` blocks (feature_layer -2: all but the last)."""
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    model = getattr(model, "vision_model", model)  # transformers 4 wraps the tower, 5 does not
    blocks = sum(meta_numel(layer) for layer in model.encoder.layers[:depth])
    pre_norm = meta_numel(model.pre_layrnorm) if hasattr(model, "pre_layrnorm") else 0
    return meta_numel(model.embeddings) + pre_norm + blocks


@pytest.mark.parametrize("config", CONFIGS)
def test_the_parameters_printed_are_transformers_count_of_the_same_parts(tmp_path, capsys, config):
    pair = config.rsplit("-", 1)[0]
    out = dry_run(capsys, config, model_dirs(tmp_path, pair))
    llm_config, vision_config = PAIRS[pair]
    total, active = transformers_llm(llm_config)
    assert printed(out, "llm", "parameters") == total
    assert printed(out, "llm", "per token") == active
    tower = transformers_tower(vision_config, depth=vision_config.num_hidden_layers - 1)
    assert int(re.search(r"vision tower ([\d,]+)", out).group(1).replace(",", "")) == tower
    llm_b, active_b, tower_b = KNOWN_SIZES[pair]  # the shapes above are the real models'
    assert total / 1e9 == pytest.approx(llm_b, rel=0.02)
    assert active / 1e9 == pytest.approx(active_b, rel=0.02)
    whole_tower = transformers_tower(vision_config, depth=vision_config.num_hidden_layers)
    assert whole_tower / 1e9 == pytest.approx(tower_b, rel=0.1)  # "so400m", "ViT-L": round names
    # the projector: two linears from the tower's width to the LLM's and on
    width, dim = vision_config.hidden_size, llm_config.hidden_size
    assert printed(out, "encoder", "parameters") == tower + width * dim + dim + dim * dim + dim


def test_the_memory_of_an_llm_rank_is_the_hand_count(tmp_path, capsys):
    """Qwen3-30B-A3B on 8 GPUs: llm tp 2 x dp 3, ep 2 x etp 3 (edp 1), bfloat16 compute from float32
    weights, nothing frozen, the optimizer sharded: the dense parts' state over dp 3, the routers'
    and the per-head q/k norms' over all 6 ranks, the experts' whole (no replicas)."""
    out = dry_run(capsys, "qwen3-30b-a3b-siglip2-8gpu", model_dirs(tmp_path, "qwen3-30b-a3b-siglip2"))
    D, L, V, E, F = 2048, 48, 151936, 128, 768
    attention = D * 32 * 128 + 2 * D * 4 * 128 + 32 * 128 * D
    dense = [V * D // 2, L * attention // 2, (2 * L + 1) * D, D * V // 2]  # embedding, attention, norms, output
    pool = [L * D * E, L * 2 * 128]  # routers, q/k norms
    experts = L * E * 3 * D * F // 6
    held = sum(dense) + sum(pool) + experts
    assert f"llm: {held:,} parameters per rank; AdamW sharded over the ranks of dp_cp (3), stage (6), edp (1)" in out
    row = next(cells for cells in map(str.split, out.splitlines()) if cells[:2] == ["llm", "0-5"])
    weights, casts, grads, adamw, activations, boundary, reduction, total = (float(cell) for cell in row[2:])
    gib = 2**30
    matrices = L * attention // 2 + experts + D * V // 2
    pieces = sum(-(-n // 3) for n in dense) + sum(-(-n // 6) for n in pool) + experts
    assert (weights, casts, grads, adamw) == (round(4 * held / gib, 1), round(2 * matrices / gib, 1),
                                              round(4 * held / gib, 1), round(8 * pieces / gib, 1))
    tokens = int(re.search(r"of at most ([\d,]+) tokens per LLM rank", out).group(1).replace(",", ""))
    per_token_layer = 4 * D + (2 * 32 + 2 * 4) * 128 // 2 + 8 * (2 * D + 3 * F // 3) // 2  # elements, bf16
    assert activations == round(tokens * (L * per_token_layer * 2 + V // 2 * 4) / gib, 1)
    vocabulary = 4 * V * D // 2  # the vocabulary's gradients: a bucket of their own, its shard a third of it
    assert reduction == round((vocabulary + 3 * vocabulary // 3) / gib, 1)
    assert boundary == 0.0  # 2 x 1,152 image rows of 4 KiB a microbatch
    assert total == pytest.approx(weights + casts + grads + adamw + activations + boundary + reduction, abs=0.25)


def test_a_dry_run_starts_nothing_and_imports_no_torch(tmp_path):
    """No router, worker or run directory: the dry run runs in a process where starting one fails,
    and leaves its working directory empty."""
    overrides = model_dirs(tmp_path / "models", "qwen3-30b-a3b-siglip2")
    work = tmp_path / "work"
    work.mkdir()
    script = (
        "import subprocess, sys\n"
        "def refuse(*a, **k): raise AssertionError('a dry run started a process')\n"
        "subprocess.Popen = refuse\n"
        "import dyad.router.launcher, dyad.app.jobs\n"
        "dyad.app.jobs.run_job = refuse\n"
        "from dyad.app.cli import main\n"
        "try:\n"
        f"    main(['train', '--config', 'qwen3-30b-a3b-siglip2-8gpu', '--dry-run', "
        f"*{[a for o in overrides for a in ('--set', o)]!r}])\n"
        "except SystemExit as exited:\n"
        "    print('exit', exited.code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=work, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.stdout.splitlines()[-1] == "exit 0 False", (result.stdout, result.stderr)
    assert "step 0 as the router plans it" in result.stdout
    assert list(work.iterdir()) == []
