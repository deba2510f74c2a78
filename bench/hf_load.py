"""Loading a Hugging Face checkpoint: dyad's reader (each rank reads its own pieces from the
memory-mapped safetensors files, dyad/slices.py) against transformers' `from_pretrained` on the
same files.

Writes a Qwen3-MoE checkpoint with random weights (bench/llm_step.py's "qwen3-1b-active" shape
by default: 2.85 B parameters, 5.7 GB in bfloat16, in shards of at most 5 GB with their index),
then times, in turn and `--repeats` times each, with the files in the page cache (just written,
and read by every run before it):
- `dyad-whole`: the whole model into a float32 `MoELM` on the device (one rank, or any rank of a
  layout that replicates it), as a run's worker loads it (`LLMWorker.load_pretrained`);
- `dyad-ep8-rank`: what one rank of an ep8 layout reads: everything but the experts whole, and 4
  of the 32 experts of each layer (the sources read directly, as `load_pieces` asks them);
- `transformers`: `AutoModelForCausalLM.from_pretrained(dir, dtype=float32, device_map=device)`
  (without `accelerate` installed: onto the host, then `.to(device)`; the JSON says which).
GB/s is the checkpoint's bytes read (the rank's share for dyad-ep8-rank) over the seconds.

    python bench/hf_load.py --out $OUT/hf_load.json [--dir DIR: keep the checkpoint there]
    python bench/hf_load.py --toy          # CPU, tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from llm_step import CONFIGS  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script
from safetensors.torch import save_file

from dyad.hf_checkpoint import HFCheckpoint
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.llm_service.hf import hf_tensors, llm_sources
from dyad.llm_service.model import MoELM
from dyad.slices import everything, load_pieces

SHARD_BYTES = 5 * 2**30
EXPERT_TENSORS = ("feed_forward.w13_ED2F", "feed_forward.w2_EFD")
TOY = LLMConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm="head",
                dense_layers=(), max_seq_len=64, moe=MoEConfig(num_experts=8, top_k=2, expert_dim=32))


def hf_config(cfg) -> dict:
    return {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.dense_ffn_dim,
        "moe_intermediate_size": cfg.moe.expert_dim, "num_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.top_k, "decoder_sparse_step": 1, "mlp_only_layers": list(cfg.dense_layers),
        "norm_topk_prob": True, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": False, "hidden_act": "silu",
        "router_aux_loss_coef": 0.0, "dtype": "bfloat16",
    }


def write_checkpoint(cfg, directory: Path, device: str) -> int:
    """Random bfloat16 weights under Qwen3-MoE's names, sharded as transformers shards; its bytes."""
    with torch.device("meta"):
        shapes = hf_tensors(MoELM(cfg).state_dict(), cfg, "qwen3_moe")
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device).manual_seed(0)
    shards, shard, size, total = [], {}, 0, 0
    for name, meta in shapes.items():
        tensor = (torch.randn(meta.shape, device=device, generator=generator) * 0.02).to(torch.bfloat16).cpu()
        if shard and size + tensor.nbytes > SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
        shard[name], size, total = tensor, size + tensor.nbytes, total + tensor.nbytes
    shards.append(shard)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(hf_config(cfg)))
    return total


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def dyad_whole(cfg, directory: Path, device: str) -> int:
    """A worker also draws the initial weights first (the rows and parts no checkpoint holds);
    here the model is allocated only, as transformers allocates what it loads."""
    with torch.device("meta"):
        model = MoELM(cfg)
    model.to_empty(device=device)
    load_pieces(model, llm_sources(HFCheckpoint(directory), cfg))
    synchronize(device)
    return sum(p.numel() * 2 for p in model.parameters())  # bytes read: the checkpoint's bfloat16


def dyad_ep8_rank(cfg, directory: Path, device: str) -> int:
    """Rank 0 of ep8: the replicated tensors whole, the first eighth of each layer's experts."""
    read = 0
    for name, source in llm_sources(HFCheckpoint(directory), cfg).items():
        index = everything(source.shape)
        if name.endswith(EXPERT_TENSORS):
            index = (torch.arange(source.shape[0] // 8), *index[1:])
        value = source.read(index, device).to(torch.float32)
        read += value.numel() * 2
    synchronize(device)
    return read


def transformers_load(cfg, directory: Path, device: str) -> int:
    """Straight onto the device where `accelerate` is installed (`device_map`), else through host
    memory, as transformers loads without it."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("accelerate"):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, device_map=device)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device)
    synchronize(device)
    return sum(p.numel() * 2 for p in model.parameters())


LOADERS = {"dyad-whole": dyad_whole, "dyad-ep8-rank": dyad_ep8_rank, "transformers": transformers_load}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--config", default="qwen3-1b-active")
    parser.add_argument("--dir", help="where the checkpoint is written (default: a temporary directory, removed after)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    cfg = TOY if device == "cpu" else CONFIGS[args.config]["llm"]
    with tempfile.TemporaryDirectory(prefix="dyad-bench-hf-load-") as scratch:
        run(args, cfg, device, Path(args.dir or scratch))


def run(args, cfg, device: str, directory: Path) -> None:
    started = time.perf_counter()
    total = write_checkpoint(cfg, directory, device)
    print(f"wrote {total / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s to {directory}", flush=True)
    import importlib.util

    result = {**run_header(device), "config": args.config, "checkpoint_bytes": total, "runs": {},
              "transformers_device_map": bool(importlib.util.find_spec("accelerate"))}
    names = args.loaders.split(",")
    for repeat in range(args.repeats):
        for name in names:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            started = time.perf_counter()
            read = LOADERS[name](cfg, directory, device)
            seconds = time.perf_counter() - started
            result["runs"].setdefault(name, []).append({"seconds": seconds, "bytes": read, "gb_per_s": read / seconds / 1e9})
            print(f"{repeat}: {name:14s} {read / 1e9:6.2f} GB in {seconds:6.2f} s: {read / seconds / 1e9:5.2f} GB/s",
                  flush=True)
    for name, runs in result["runs"].items():
        seconds = statistics.median(r["seconds"] for r in runs)
        print(f"{name:14s} median {seconds:6.2f} s, {runs[0]['bytes'] / seconds / 1e9:5.2f} GB/s "
              f"({len(runs)} runs)")
    write_json(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
