"""Packed rows against right-padded ones: the LLM service's training step on the same samples,
a conversation-like mix of lengths (text of a long-tailed length, none to two images of several
sizes, each its native-resolution token count), one sample a row right-padded to its
microbatch's longest, or the microbatch's samples packed into rows of up to 4,096 tokens the way
the router packs them (`dyad.router.packing.pack_rows`: each sample attending only to itself,
its positions restarting). Reports tokens/s of real tokens and the padding fraction of each
(padding columns over all columns computed).

    python bench/packing.py --out $OUT/packing.json     # GPU: Qwen3-MoE's shape at ~1 B active (llm_step.py's)
    python bench/packing.py --toy                       # CPU, tiny (CI)

Packed rows need less memory than right-padded ones of the same samples, so a packed run can take
more samples a microbatch in the padded run's memory: `--packed-per-microbatch 16 32` adds packed
runs with that many (each variant's peak memory is reported beside its tokens/s).

Both run eager (or with `--compile`, each block compiled) in bf16 autocast with float32 master weights, fused AdamW, the same microbatches
(gradients accumulated over them), the same optimizer step. Packed rows attend through the
model's segments of whole rows (`MoELM(documents_BS=, document_bounds=)`: flash attention's
variable-length kernel, causal within each sample), the right-padded ones causally.
"""

from __future__ import annotations

import argparse
import random

import torch
from llm_step import CONFIGS  # beside this script
from moe_layer import median_ms  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script

from dyad.compile import compile_blocks
from dyad.llm_service.model import MoELM
from dyad.llm_service.sharding import document_segments
from dyad.optim import build_optimizer
from dyad.router.packing import pack_rows

IMAGE_SIDES = (224, 336, 448, 672, 896, 1344)  # pixels of a square image; tokens: (side / 32)^2 after the 2x2 merge


def sample_lengths(count: int, longest: int, seed: int = 0) -> list[int]:
    """Tokens of `count` conversation-like samples: text of log-normal length (median ~250),
    and none (30 %), one (55 %) or two (15 %) images of `IMAGE_SIDES`; at most `longest`."""
    draw = random.Random(seed)
    lengths = []
    for _ in range(count):
        text = int(draw.lognormvariate(5.5, 0.8))
        images = draw.choices((0, 1, 2), weights=(30, 55, 15))[0]
        tokens = text + sum((draw.choice(IMAGE_SIDES) // 32) ** 2 for _ in range(images))
        lengths.append(max(8, min(tokens, longest)))
    return lengths


def microbatch_inputs(lengths: list[int], seq_len: int, packed: bool, vocab: int, device: str) -> dict:
    """One microbatch's model inputs: a row per sample, right-padded, or its samples packed into
    rows of `seq_len`; and its real tokens and columns computed."""
    rows = pack_rows(lengths, seq_len) if packed else [[i] for i in range(len(lengths))]
    S = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.randint(1, vocab, (len(rows), S))
    targets = torch.full((len(rows), S), -100)
    documents, positions = torch.full((len(rows), S), -1), torch.zeros((len(rows), S), dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for i in row:
            n = lengths[i]
            targets[b, at : at + n - 1] = ids[b, at + 1 : at + n]
            documents[b, at : at + n], positions[b, at : at + n] = i, torch.arange(n)
            at += n
    inputs = {"input_ids_BS": ids, "valid_BS": documents >= 0}
    if packed:
        inputs |= {"documents_BS": documents, "sample_positions_BS": positions}
    inputs = {k: v.to(device) for k, v in inputs.items()}
    if packed:  # the segments' bounds, as a rank holding whole rows builds them on the host (shard_microbatch)
        cu_seqlens, longest = document_segments(documents)
        inputs["document_bounds"] = (cu_seqlens.to(device), longest)
    return {"inputs": inputs, "targets": targets.to(device),
            "tokens": sum(lengths), "columns": len(rows) * S, "rows": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64, help="samples a step (GPU)")
    parser.add_argument("--per-microbatch", type=int, default=4, help="samples a microbatch (GPU)")
    parser.add_argument("--packed-per-microbatch", type=int, nargs="*", default=[],
                        help="also packed with this many samples a microbatch (the step's samples unchanged)")
    parser.add_argument("--compile", action="store_true", help="GPU: each block compiled (train.compile)")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    spec = CONFIGS["toy" if device == "cpu" else "qwen3-1b-active"]
    cfg, seq_len = spec["llm"], spec["seq"]
    samples, per_microbatch = (8, 2) if device == "cpu" else (args.samples, args.per_microbatch)
    lengths = sample_lengths(samples, seq_len)
    if device == "cpu":  # the toy's 64-token rows: the same mix, 32 times shorter
        lengths = [max(4, n // 32) for n in sample_lengths(samples, 32 * seq_len)]
    result = {**run_header(device), "config": "toy" if device == "cpu" else "qwen3-1b-active", "seq_len": seq_len,
              "samples": samples, "per_microbatch": per_microbatch, "compiled": args.compile and device == "cuda", "real_tokens": sum(lengths), "variants": {}}
    runs = [("right-padded", False, per_microbatch), ("packed", True, per_microbatch)]
    runs += [(f"packed-{n}-a-microbatch", True, n) for n in args.packed_per_microbatch]
    for name, packed, per_microbatch in runs:
        torch.manual_seed(0)
        model = MoELM(cfg).to(device)
        if args.compile and device == "cuda":
            # Each variant its own compilation, as its own run would be: the variants' models share
            # the blocks' code, and with it dynamo's limit of recompilations (shapes differ by
            # microbatch).
            torch._dynamo.reset()
            compile_blocks(model)
        train = argparse.Namespace(weight_decay=0.01, beta1=0.9, beta2=0.95, eps=1e-8, lr=1e-4)
        optimizer = build_optimizer(model, train)
        microbatches = [microbatch_inputs(lengths[i : i + per_microbatch], seq_len, packed, cfg.vocab_size, device)
                        for i in range(0, samples, per_microbatch)]
        real = sum(mb["tokens"] for mb in microbatches)

        def step(model=model, optimizer=optimizer, microbatches=microbatches, real=real):
            for mb in microbatches:
                with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                    logits, aux = model(**mb["inputs"])
                    loss = model.loss_sum(logits, mb["targets"]) / real + aux / len(microbatches)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            seconds = median_ms(step, args.iters, device) / 1e3
        except torch.OutOfMemoryError:  # too many samples a microbatch for the GPU: the others still run
            result["variants"][name] = {"per_microbatch": per_microbatch, "out_of_memory": True}
            print(f"{name:12s} out of GPU memory", flush=True)
            del model, optimizer, microbatches, step
            torch.cuda.empty_cache()
            continue
        columns = sum(mb["columns"] for mb in microbatches)
        entry = {"per_microbatch": per_microbatch, "step_s": seconds, "tokens_per_s": real / seconds, "rows": sum(mb["rows"] for mb in microbatches),
                 "columns": columns, "padding_fraction": 1 - real / columns,
                 "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0}
        result["variants"][name] = entry
        print(f"{name:12s} {real:,} tokens in {entry['rows']} rows, padding {entry['padding_fraction']:.1%}: "
              f"{seconds * 1e3:.1f} ms a step, {real / seconds:,.0f} tokens/s, peak {entry['peak_memory_gb']:.1f} GB")
        del model, optimizer, microbatches
        if device == "cuda":
            torch.cuda.empty_cache()
    padded = result["variants"]["right-padded"]["tokens_per_s"]
    result["over_padded"] = {name: entry["tokens_per_s"] / padded for name, entry in result["variants"].items()
                             if "tokens_per_s" in entry}
    result["packed_over_padded"] = result["over_padded"]["packed"]
    print("over right-padded tokens/s: " + ", ".join(f"{n} {x:.2f}x" for n, x in result["over_padded"].items()))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
