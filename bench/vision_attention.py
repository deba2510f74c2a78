"""The vision tower's attention alone, forward + backward over one packed batch of images of
mixed sizes (bench/vision_tower.py's `SIZES`: Qwen3-VL's tower, 16 heads of 72), run several
ways: flash attention's variable-length kernel over all images at once (`varlen`: what
`dyad.kernels.varlen_attention` runs), one SDPA call per image with each backend (cuDNN, flash,
memory-efficient: transformers' non-flash path is the per-image loop), one cuDNN call per group
of same-size images, SDPA on a nested (jagged) tensor, and cuDNN's attention over all the
packed images in one call (`cudnn-varlen`: the op SDPA's cuDNN backend runs for a nested tensor). Each way's output and input gradients
are compared with the first's; time per layer, and times the tower's 27 layers.

    python bench/vision_attention.py --out $OUT/vision_attention.json   # on a GPU host
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

from dyad.kernels.varlen_attention import segment_bounds, varlen_attention

DEPTH = 27


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
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    dtype, sizes, heads, head_dim = ((torch.bfloat16, SIZES, 16, 72) if device == "cuda"
                                     else (torch.float32, TOY_SIZES, 2, 8))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    lengths = [h * w for h, w in sizes]
    cu, longest = segment_bounds(lengths, device)
    torch.manual_seed(0)
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    upstream = torch.randn(sum(lengths), heads, head_dim, device=device, dtype=dtype)
    ways = {
        "varlen": lambda q, k, v: varlen_attention(q, k, v, cu, longest),
        "cudnn-per-image": per_image(lengths, SDPBackend.CUDNN_ATTENTION),
        "flash-per-image": per_image(lengths, SDPBackend.FLASH_ATTENTION),
        "efficient-per-image": per_image(lengths, SDPBackend.EFFICIENT_ATTENTION),
        "cudnn-bucketed": bucketed(sizes, lengths, SDPBackend.CUDNN_ATTENTION),
        "jagged": jagged(cu, longest),
        "cudnn-varlen": cudnn_varlen(cu, longest, head_dim**-0.5),
    }
    result = {**run_header(device), "sizes": sizes, "heads": heads, "head_dim": head_dim, "ways": {}}
    first = None
    for name, attend in ways.items():
        def step(attend=attend):
            qkv.grad = None
            out = attend(*qkv.unbind(1))
            out.backward(upstream)
            return out
        try:
            out = step()
            sync()
            if first is None:
                first = (out.detach().float(), qkv.grad.float().clone())
            error = ((out.float() - first[0]).abs().max().item(), (qkv.grad.float() - first[1]).abs().max().item())
            for _ in range(3):
                step()
            sync()
            start = time.perf_counter()
            for _ in range(args.iters):
                step()
            sync()
            ms = (time.perf_counter() - start) / args.iters * 1e3
            entry = {"ms_one_layer": ms, f"ms_{DEPTH}_layers": ms * DEPTH, "max_abs_error_out_grad": error}
        except (RuntimeError, NotImplementedError) as failure:  # a backend that does not run here
            entry = {"error": repr(failure)[:300]}
        result["ways"][name] = entry
        print(name, entry, flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
