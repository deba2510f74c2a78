"""`dyad export CHECKPOINT --to-hf OUT`: a committed checkpoint as a Hugging Face model directory
that transformers loads with `from_pretrained`, whatever layout wrote it. A run of a pretrained
tower and LLM (`encoder.from_hf`, `llm.from_hf`, the projector LLaVA's shape: `spatial_merge` 1)
is written whole, as a `LlavaForConditionalGeneration` (`export_llava`); a run of a whole
Qwen3-VL(-MoE) (its native tower and its LLM from the same checkpoint) as its own class
(`export_qwen3_vl`); otherwise, or with `--llm-only`, the LLM alone as its family's class
(`export_llm`). A directory holds config.json
(the sources', the vocabulary the run's), the weights in safetensors files (shards of at most
`SHARD_BYTES` and their index where there is more than one), the run's tokenizer.json and the
LLM source's other tokenizer and generation files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from dyad.checkpoint import load_pool_state
from dyad.config import RunConfig
from dyad.data import make_dataset
from dyad.encoder_service.hf import tower_prefix, tower_tensors
from dyad.encoder_service.hf_config import vision_config
from dyad.hf import qwen3_vl_to_hf
from dyad.hf_checkpoint import HFCheckpoint, read_config
from dyad.llm_service.hf import hf_tensors
from dyad.llm_service.hf_config import QWEN3_VL, exported_config, text_config

SHARD_BYTES = 5 * 2**30
# Beside the weights in a model directory, what describes its tokenizer and generation.
_SOURCE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # a native tower's image processor


def llava_shaped(config: RunConfig) -> bool:
    """Whether the run is a LLaVA: a pretrained fixed-resolution tower, its projector LLaVA's, a
    pretrained LLM."""
    encoder = config.encoder
    return bool(encoder.from_hf and config.llm.from_hf) and encoder.native is None and encoder.spatial_merge == 1


def qwen3_vl_whole(config: RunConfig) -> bool:
    """Whether the run is a whole Qwen3-VL(-MoE): its native tower and its LLM, both from one
    checkpoint of the whole model."""
    encoder, llm = config.encoder, config.llm
    return (encoder.native is not None and bool(llm.from_hf)
            and read_config(llm.from_hf, "llm.from_hf").get("model_type") in QWEN3_VL)


def export_llm(config: RunConfig, checkpoint: Path, out: Path) -> list[Path]:
    """Write the LLM of `checkpoint` (a run of `config`) to `out` (new, or empty); returns the
    weight files written."""
    if not config.llm.from_hf:
        raise ValueError(
            "--to-hf needs a run whose LLM came from a Hugging Face checkpoint (llm.from_hf): its "
            "family's transformers class is what the export loads as"
        )
    _check_empty(out)
    source = text_config(read_config(config.llm.from_hf, "llm.from_hf"))
    tensors = hf_tensors(load_pool_state(checkpoint, "llm"), config.llm, source["model_type"])
    return _write(out, tensors, exported_config(source, config.llm), config)


def export_llava(config: RunConfig, checkpoint: Path, out: Path) -> list[Path]:
    """Write the whole of `checkpoint` (a `llava_shaped` run of `config`) to `out` as a LLaVA: the
    tower as its source's (the blocks past the feature layer, which the run never used, and its
    final norm, the source's), the run's projector, the LLM, the run's `<image>` id as its image
    placeholder; returns the weight files written."""
    _check_empty(out)
    text = text_config(read_config(config.llm.from_hf, "llm.from_hf"))
    tower_source = HFCheckpoint(config.encoder.from_hf)
    vision = vision_config(tower_source.config)
    tensors = hf_tensors(load_pool_state(checkpoint, "llm"), config.llm, text["model_type"], head="language_model.")
    prefix = "vision_tower.vision_model."  # as the hub's LLaVAs name them; transformers 4 and 5 read it
    trained = tower_tensors(load_pool_state(checkpoint, "encoder"), config.encoder, prefix)
    source_prefix = tower_prefix(tower_source)
    for name in sorted(tower_source.names):
        if name.startswith(source_prefix) and prefix + name.removeprefix(source_prefix) not in trained:
            shape = tower_source.shape(name)
            trained[prefix + name.removeprefix(source_prefix)] = tower_source.stored(name, shape).full()
    hf_config = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": exported_config(text, config.llm),
        "vision_config": vision,
        "image_token_index": make_dataset(config.data).tokenizer.image_id,
        "image_seq_length": config.encoder.tokens_per_image,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": config.encoder.feature_layer,
        # LLaVA's "default" drops the first token (CLIP's class token), "full" keeps them all
        "vision_feature_select_strategy": "default" if config.encoder.cls_token else "full",
        "tie_word_embeddings": False,
    }
    return _write(out, tensors | trained, hf_config, config)


def export_qwen3_vl(config: RunConfig, checkpoint: Path, out: Path) -> list[Path]:
    """Write the whole of `checkpoint` (a `qwen3_vl_whole` run of `config`) to `out` as its
    checkpoint's class (`dyad.hf.qwen3_vl_to_hf`), the run's `<image>` id as the image
    placeholder; with the source's image processor config; returns the weight files written."""
    _check_empty(out)
    source = read_config(config.llm.from_hf, "llm.from_hf")
    tensors, hf_config = qwen3_vl_to_hf(load_pool_state(checkpoint, "encoder"), config.encoder.native,
                                        load_pool_state(checkpoint, "llm"), config.llm, source)
    hf_config |= {"image_token_id": make_dataset(config.data).tokenizer.image_id}
    written = _write(out, tensors, hf_config, config)
    for name in _PROCESSOR_FILES:
        if (Path(config.encoder.from_hf) / name).is_file():
            shutil.copyfile(Path(config.encoder.from_hf) / name, out / name)
    return written


def _check_empty(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--to-hf: {out} exists and is not empty")


def _write(out: Path, tensors: dict, hf_config: dict, config: RunConfig) -> list[Path]:
    """The weights, config.json (in the weights' dtype), and the run's tokenizer and the LLM
    source's other files, in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    written = _save_sharded(tensors, out)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config | {"dtype": dtype}, indent=2))
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
