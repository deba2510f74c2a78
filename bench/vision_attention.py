"""The vision tower's attention alone, forward + backward over one packed batch of images of
mixed sizes (bench/vision_tower.py's `SIZES`: Qwen3-VL's tower, 16 heads of 72), run several
ways: flash attention's variable-length kernel over all images at once, torch's (`varlen`) and
FlashAttention-4's where flash-attn-4 is installed (`flash4-varlen`; `dyad.kernels.varlen_attention`
runs it where it is installed, else torch's), one SDPA call per image with each backend (cuDNN, flash,
memory-efficient: transformers' non-flash path is the per-image loop), one cuDNN call per group
of same-size images, SDPA on a nested (jagged) tensor, and cuDNN's attention over all the
packed images in one call (`cudnn-varlen`: the op SDPA's cuDNN backend runs for a nested tensor). Each way's output and input gradients
are compared with the first's; time per layer, and times the tower's 27 layers.

`--llm` times instead the LLM's causal attention at bench/llm_step.py's Qwen3 shape (8 sequences of
4,096 tokens, 32 query heads and 4 key heads of 128; 16 layers): SDPA (cuDNN on an H200, what the
LLM runs without flash-attn-4) against FlashAttention-4.

    python bench/vision_attention.py --out $OUT/vision_attention.json   # on a GPU host
    python bench/vision_attention.py --llm --out $OUT/llm_attention.json
    python bench/vision_attention.py --toy                               # CPU, tiny (CI): the ways that run there
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from run_info import bench_device, run_header, write_json  # beside this script
from torch.nn.attention import SDPBackend, sdpa_kernel
from vision_tower import SIZES, TOY_SIZES  # beside this script

from dyad.kernels.flash4 import FLASH4, flash4_applies, flash4_attention
from dyad.kernels.varlen_attention import segment_bounds, varlen_attention

DEPTH = 27
LLM_LAYERS = 16


def dyad_varlen(cu, longest, flash4: bool):
    """dyad's variable-length attention with FlashAttention-4 allowed or not."""
    def attend(q, k, v):
        FLASH4["enabled"] = flash4
        try:
            return varlen_attention(q, k, v, cu, longest)
        finally:
            FLASH4["enabled"] = True
    return attend


def llm_ways(device: str, dtype: torch.dtype):
    """(q, k, v, upstream, ways) of the LLM's causal attention: [B, S, heads, Dh] operands."""
    B, S, H, G, Dh = (8, 4096, 32, 4, 128) if device == "cuda" else (2, 16, 4, 2, 8)
    q = torch.randn(B, S, H, Dh, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, S, G, Dh, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    upstream = torch.randn(B, S, H, Dh, device=device, dtype=dtype)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True,
                                              enable_gqa=True).transpose(1, 2)
    ways = {"sdpa": sdpa}
    if flash4_applies(q, k, v):
        ways["flash4"] = lambda q, k, v: flash4_attention(q, k, v, causal=True)
    return (q, k, v), upstream, ways


def per_image(lengths, backend):
    def attend(q, k, v):
        outs = []
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
            a = [x.transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs)]
            with sdpa_kernel(backend):
                outs.append(F.scaled_dot_product_attention(*a).squeeze(0).transpose(0, 1))
        return torch.cat(outs)
    return attend


def bucketed(sizes, lengths, backend):
    """Images of one size in one call."""
    order = sorted(range(len(lengths)), key=lambda i: sizes[i])

    def attend(q, k, v):
        parts = [None] * len(lengths)
        qs, ks, vs = (x.split(lengths) for x in (q, k, v))
        i = 0
        while i < len(order):
            j = i
            while j < len(order) and sizes[order[j]] == sizes[order[i]]:
                j += 1
            same = order[i:j]
            a = [torch.stack([xs[n] for n in same]).transpose(1, 2) for xs in (qs, ks, vs)]
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(*a).transpose(1, 2)
            for n, on in zip(same, o.unbind(0)):
                parts[n] = on
            i = j
        return torch.cat(parts)
    return attend


def jagged(cu, longest):
    def attend(q, k, v):
        a = [torch.nested.nested_tensor_from_jagged(x, cu.long(), max_seqlen=longest).transpose(1, 2) for x in (q, k, v)]
        return F.scaled_dot_product_attention(*a).transpose(1, 2).values()
    return attend


def cudnn_varlen(cu, longest, scale):
    """cuDNN's attention over the packed segments in one call (the op SDPA runs for a jagged
    nested tensor on its cuDNN backend), its backward the op's own derivative."""
    def attend(q, k, v):
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest, True, 0.0, False,
                                                       False, scale=scale)[0]
    return attend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--llm", action="store_true", help="the LLM's causal attention instead of the tower's")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    dtype, sizes, heads, head_dim = ((torch.bfloat16, SIZES, 16, 72) if device == "cuda"
                                     else (torch.float32, TOY_SIZES, 2, 8))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    if args.llm:
        operands, upstream, ways = llm_ways(device, dtype)
        result = {**run_header(device), "shape": {"q": list(operands[0].shape), "kv": list(operands[1].shape)},
                  "ways": {}}
        time_ways(ways, operands, upstream, LLM_LAYERS, args.iters, sync, result)
        write_json(args.out, result)
        return
    lengths = [h * w for h, w in sizes]
    cu, longest = segment_bounds(lengths, device)
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    upstream = torch.randn(sum(lengths), heads, head_dim, device=device, dtype=dtype)
    ways = {
        "varlen": dyad_varlen(cu, longest, flash4=False),
        "flash4-varlen": dyad_varlen(cu, longest, flash4=True),
        # the kernel at the head dim as it is, which dyad pads to 96 (dyad/kernels/flash4.py)
        "flash4-varlen-unpadded": lambda q, k, v: torch.ops.dyad.flash4_attention(q, k, v, cu, longest,
                                                                                  head_dim**-0.5, False)[0],
        "cudnn-per-image": per_image(lengths, SDPBackend.CUDNN_ATTENTION),
        "flash-per-image": per_image(lengths, SDPBackend.FLASH_ATTENTION),
        "efficient-per-image": per_image(lengths, SDPBackend.EFFICIENT_ATTENTION),
        "cudnn-bucketed": bucketed(sizes, lengths, SDPBackend.CUDNN_ATTENTION),
        "jagged": jagged(cu, longest),
        "cudnn-varlen": cudnn_varlen(cu, longest, head_dim**-0.5),
    }
    if not flash4_applies(*qkv.unbind(1)):
        del ways["flash4-varlen"], ways["flash4-varlen-unpadded"]  # no flash-attn-4 here (or not for this device)
    result = {**run_header(device), "sizes": sizes, "heads": heads, "head_dim": head_dim, "ways": {}}
    time_ways(ways, qkv.unbind(1), upstream, DEPTH, args.iters, sync, result)
    write_json(args.out, result)


def time_ways(ways, operands, upstream, layers, iters, sync, result) -> None:
    """Each way's forward + backward: its output's and input gradients' largest difference from
    the first way's, ms a layer and times `layers`; into result["ways"]."""
    first = None
    leaves = [x for x in operands if x.is_leaf] or [operands[0]._base]
    for name, attend in ways.items():
        def step(attend=attend):
            for leaf in leaves:
                leaf.grad = None
            out = attend(*operands)
            out.backward(upstream)
            return out
        try:
            out = step()
            sync()
            grads = torch.cat([leaf.grad.float().flatten() for leaf in leaves])
            if first is None:
                first = (out.detach().float(), grads)
            error = ((out.float() - first[0]).abs().max().item(), (grads - first[1]).abs().max().item())
            for _ in range(3):
                step()
            sync()
            start = time.perf_counter()
            for _ in range(iters):
                step()
            sync()
            ms = (time.perf_counter() - start) / iters * 1e3
            entry = {"ms_one_layer": ms, f"ms_{layers}_layers": ms * layers, "max_abs_error_out_grad": error}
        except (RuntimeError, NotImplementedError) as failure:  # a backend that does not run here
            entry = {"error": repr(failure)[:300]}
        result["ways"][name] = entry
        print(name, entry, flush=True)


if __name__ == "__main__":
    main()
