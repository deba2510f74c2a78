"""`dyad export CHECKPOINT --to-hf OUT`: a committed checkpoint's LLM as a Hugging Face model
directory that transformers loads with `from_pretrained` (its family's class: the one
`llm.from_hf` came from), whatever layout wrote it: config.json (the source's, its vocabulary
the run's), the weights in safetensors files (shards of at most `SHARD_BYTES` and their index
where there is more than one), the run's tokenizer.json and the source's other tokenizer and
generation files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from dyad.checkpoint import load_pool_state
from dyad.config import RunConfig
from dyad.hf_checkpoint import read_config
from dyad.llm_service.hf import hf_tensors
from dyad.llm_service.hf_config import exported_config

SHARD_BYTES = 5 * 2**30
# Beside the weights in a model directory, what describes its tokenizer and generation.
_SOURCE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


def export_llm(config: RunConfig, checkpoint: Path, out: Path) -> list[Path]:
    """Write the LLM of `checkpoint` (a run of `config`) to `out` (new, or empty); returns the
    weight files written."""
    if not config.llm.from_hf:
        raise ValueError(
            "--to-hf needs a run whose LLM came from a Hugging Face checkpoint (llm.from_hf): its "
            "family's transformers class is what the export loads as"
        )
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--to-hf: {out} exists and is not empty")
    source = read_config(config.llm.from_hf, "llm.from_hf")
    tensors = hf_tensors(load_pool_state(checkpoint, "llm"), config.llm, source["model_type"])
    out.mkdir(parents=True, exist_ok=True)
    written = _save_sharded(tensors, out)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(exported_config(source, config.llm) | {"dtype": dtype}, indent=2))
    if config.data.tokenizer:
        shutil.copyfile(config.data.tokenizer, out / "tokenizer.json")
    for name in _SOURCE_FILES:
        if (Path(config.llm.from_hf) / name).is_file():
            shutil.copyfile(Path(config.llm.from_hf) / name, out / name)
    return written


def _save_sharded(tensors: dict, out: Path) -> list[Path]:
    shards: list[dict] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return [out / "model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [out / name for name in names]
