"""Qwen3-VL's native-resolution vision tower, forward + backward on a batch of images of mixed
sizes: dyad's `Qwen3VLVision` (dyad/encoder_service/qwen3_vl.py: one packed sequence, each image
attending only to itself through flash attention's variable-length kernel) against transformers'
own `Qwen3VLMoeVisionModel` (its "sdpa" attention) with the same weights, timed in turn. bf16
weights and inputs; the upstream gradient a random [tokens, out] per output (merged tokens and
every DeepStack feature).

The tower is Qwen3-VL-30B-A3B's (depth 27, 1152 wide, 16 heads, MLP 4304, patch 16, 2x2 merge,
DeepStack after blocks 8, 16 and 24, out 2048; ~0.6 B parameters), random weights saved with
transformers and loaded by `dyad.hf.load`. Images: a skewed mix of sizes (`SIZES`, in patches),
as a conversation dataset at native resolution gives them.

    python bench/vision_tower.py --out $OUT/vision_tower.json      # on a GPU host
    python bench/vision_tower.py --toy                              # CPU, tiny, float32 (CI)

Tokens/s counts the patches the tower attends over. On a GPU dyad's tower also runs with each
block compiled (`dyad-compiled`, as `train.compile` compiles the encoder pool's). Where
flash-attn-4 is installed dyad's attention runs FlashAttention-4, and `dyad-compiled-torch-varlen`
is the compiled tower on torch's variable-length flash kernel instead. `--timeline-dir`
writes each variant's kernels in order (`bench/kernel_timeline.py`).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from kernel_timeline import write_timeline  # beside this script
from moe_layer import time_interleaved  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script

import dyad.hf
from dyad.compile import compile_blocks
from dyad.kernels.flash4 import FLASH4, flash4_applies

TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
             temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[8, 16, 24],
             num_position_embeddings=2304, out_hidden_size=2048, hidden_act="gelu_pytorch_tanh")
TOY = dict(TOWER, depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
           deepstack_visual_indexes=[0], num_position_embeddings=16, out_hidden_size=24)
# (rows, columns) of patches: thumbnails, screenshots, photos, documents; 18,112 patches in all
SIZES = [(16, 16)] * 8 + [(32, 24), (24, 32), (32, 32), (48, 36), (40, 56), (64, 48), (28, 40), (20, 80), (72, 52)]
TOY_SIZES = [(4, 4), (4, 8), (8, 6)]


def random_towers(shape: dict, dtype: torch.dtype, device: str, copies: int = 1):
    """transformers' `Qwen3VLMoeVisionModel` of `shape` with random weights (from torch's current
    seed), and `copies` of dyad's tower loaded from its save by `dyad.hf.load`."""
    from transformers import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    config = Qwen3VLMoeVisionConfig(**shape)
    config._attn_implementation = "sdpa"
    theirs = Qwen3VLMoeVisionModel(config).to(dtype)
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        ours = [dyad.hf.load(directory, dtype=dtype, device=device) for _ in range(copies)]
    return theirs.to(device), ours


def packed_images(shape: dict, sizes: list[tuple[int, int]], dtype: torch.dtype, device: str):
    """One packed batch of images of `sizes` (patch rows, columns) as a tower takes it: random
    pixel_values [patches, X] and grid_thw [images, 3]; and a random upstream gradient for its
    outputs, a [tokens, out] for the merged tokens and one per DeepStack feature."""
    grid_thw = torch.tensor([(1, h, w) for h, w in sizes], device=device)
    patches = int(grid_thw.prod(1).sum())
    X = shape["in_channels"] * shape["temporal_patch_size"] * shape["patch_size"] ** 2
    pixels = torch.randn(patches, X, device=device, dtype=dtype)
    tokens = patches // shape["spatial_merge_size"] ** 2
    upstream = [torch.randn(tokens, shape["out_hidden_size"], device=device, dtype=dtype)
                for _ in range(1 + len(shape["deepstack_visual_indexes"]))]
    return pixels, grid_thw, upstream


def backward(out, upstream: list[torch.Tensor]) -> None:
    """Backward from a tower's output (dyad's or transformers': the same field names) with `upstream`."""
    outputs = [out.pooler_output, *out.deepstack_features]
    sum((x.float() * u.float()).sum() for x, u in zip(outputs, upstream, strict=True)).backward()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeline-dir", help="GPU: each variant's kernels in order, with the idle gaps, are written here")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape, sizes = (TOWER, SIZES) if device == "cuda" else (TOY, TOY_SIZES)
    torch.manual_seed(0)
    flash4 = device == "cuda" and flash4_applies(*(torch.empty(1, shape["num_heads"], shape["hidden_size"] // shape["num_heads"],
                                                               device=device, dtype=dtype) for _ in range(3)))
    copies = 1 if device != "cuda" else 3 if flash4 else 2
    theirs, (ours, *compiled) = random_towers(shape, dtype, device, copies=copies)
    pixels, grid_thw, upstream = packed_images(shape, sizes, dtype, device)
    patches = pixels.shape[0]

    def step_ours():
        backward(ours(pixels, grid_thw), upstream)

    def step_theirs():
        backward(theirs(pixels, grid_thw=grid_thw), upstream)

    steps = {"dyad": step_ours, "transformers": step_theirs}
    if compiled:  # each block compiled, as train.compile does in the encoder pool
        compile_blocks(compiled[0].model)

        def step_compiled():
            backward(compiled[0](pixels, grid_thw), upstream)

        steps["dyad-compiled"] = step_compiled
    if flash4:  # the same compiled tower on torch's variable-length kernel
        compile_blocks(compiled[1].model)

        def step_torch_varlen():
            FLASH4["enabled"] = False
            try:
                backward(compiled[1](pixels, grid_thw), upstream)
            finally:
                FLASH4["enabled"] = True

        steps["dyad-compiled-torch-varlen"] = step_torch_varlen
    ms = time_interleaved(steps, args.iters, device)
    timelines = {}
    if args.timeline_dir and device == "cuda":
        for name, step in steps.items():
            timelines[name] = write_timeline(step, f"{args.timeline_dir}/vision_tower_timeline_{name}.txt", steps=1)
    result = {**run_header(device), "tower": shape, "attention": "flash4" if flash4 else "torch-varlen", "images": len(sizes), "patches": patches,
              "parameters": sum(p.numel() for p in theirs.parameters()),
              "ms": ms, "timelines": timelines, "patches_per_s": {name: patches / t * 1e3 for name, t in ms.items()}}
    result["speedup"] = {name: ms["transformers"] / t for name, t in ms.items() if name != "transformers"}
    print(f"{len(sizes)} images, {patches} patches, {result['parameters'] / 1e9:.2f} B parameters, fwd+bwd: "
          + ", ".join(f"{name} {t:.1f} ms" for name, t in ms.items())
          + "; over transformers: " + ", ".join(f"{name} {x:.2f}x" for name, x in result["speedup"].items()))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
