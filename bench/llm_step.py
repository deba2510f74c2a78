"""The LLM service's training step on one GPU: a ~1B-active-parameter MoE decoder on a fused
image + text sequence of 4,096 tokens (576 image rows spliced in), forward + backward + AdamW,
bf16 compute with float32 master weights and optimizer state. Reports model FLOPs utilisation
for each variant: one sequence per optimizer step, eight (gradients accumulated over eight
microbatches of one sequence, or four of two, or two of four: the same global batch), each eager
and with compiled blocks (`train.compile`, dyad/compile.py), and eight with float8 GEMMs
(llm.fp8; its FLOPs counted against the same bf16 peak), and with blocks recomputing their
activations (`train.recompute`; the recomputation's FLOPs are not counted, as MFU does not count
them). On a GPU each variant also reports how
long the host takes to issue one step from an idle GPU against that step's end on the GPU (close
means the step waits on the host), and the caching allocator's peak reservation and cudaMalloc
retries.

    python bench/llm_step.py --out $OUT/llm_step.json [--profile-dir $OUT]
    python bench/llm_step.py --toy                       # CPU, tiny (CI)
    python bench/llm_step.py --variants bf16-2mb-x4-compiled --without-reload-barrier

`--without-reload-barrier` compiles the blocks without dyad/inductor_reloads.py's barrier, only to
measure what the barrier costs: without it the compiled bf16 gradients can be wrong on a GPU.

MFU = (6 x active non-embedding parameters + 12 x layers x attention width x sequence) x tokens / step time /
peak, with the peak 989 TFLOP/s (H100/H200 dense bf16, as the issue counts). Active parameters:
attention, norms, router, top-k experts of each MoE layer, dense FFN layers, and the output
projection (the input embedding is a lookup).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import torch
from kernel_timeline import write_timeline  # beside this script
from moe_layer import median_ms, write_kernel_table  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script

from dyad import inductor_reloads
from dyad.compile import compile_blocks
from dyad.kernels.fp8 import compile_quantization
from dyad.kernels.flash4 import FLASH4, flash4_applies
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.llm_service.fp8 import convert_to_fp8
from dyad.llm_service.model import MoELM
from dyad.optim import build_optimizer
from dyad.recompute import recompute_blocks
from dyad.working_weights import WorkingWeights, trained_parameters

PEAK_TFLOPS = 989.0

CONFIGS = {
    "1b-active": dict(
        llm=LLMConfig(vocab_size=32000, dim=2048, n_layers=20, n_heads=16, n_kv_heads=4,
                      dense_ffn_dim=5632, dense_layers=(0,), max_seq_len=4096,
                      moe=MoEConfig(num_experts=16, top_k=4, expert_dim=1408, aux_loss_coef=0.01)),
        seq=4096, image_rows=576,
    ),
    # Qwen3-MoE's shape (its head_dim, heads, per-head q/k norms, experts of 768 with top-8, every
    # layer MoE) at ~1 B active: 32 experts where Qwen3-30B-A3B has 128, so that the float32
    # weights and AdamW state of all 2.5 B parameters fit one GPU (bench/titan_step.py: the same
    # shape in torchtitan's model).
    "qwen3-1b-active": dict(
        llm=LLMConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=4, head_dim=128,
                      qk_norm="head", rope_theta=1e6, norm_eps=1e-6, dense_layers=(), max_seq_len=4096,
                      moe=MoEConfig(num_experts=32, top_k=8, expert_dim=768, aux_loss_coef=0.01)),
        seq=4096, image_rows=576,
    ),
    "toy": dict(
        llm=LLMConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, dense_ffn_dim=128,
                      dense_layers=(0,), max_seq_len=64,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_dim=32)),
        seq=64, image_rows=8,
    ),
}


def active_parameters(cfg: LLMConfig) -> int:
    D, L = cfg.dim, cfg.n_layers
    attention = D * cfg.n_heads * cfg.head_dim * 2 + D * cfg.n_kv_heads * cfg.head_dim * 2
    moe = cfg.moe
    moe_layer = moe.top_k * 3 * D * moe.expert_dim + D * moe.num_experts + 3 * D * moe.shared_expert_dim
    dense_layer = 3 * D * cfg.dense_ffn_dim
    n_dense = len(cfg.dense_layers)
    per_layer_norms = 2 * D
    return L * (attention + per_layer_norms) + n_dense * dense_layer + (L - n_dense) * moe_layer + D * cfg.vocab_size


class Variant(NamedTuple):
    microbatches: int  # per optimizer step, gradients accumulated
    sequences: int = 1  # 4,096-token sequences per microbatch (Megatron's micro-batch size)
    fp8: str | None = None  # float8 GEMMs: no / "eager" / "compiled" quantization
    compiled_blocks: bool = False
    recompute: bool = False  # blocks recompute their activations in the backward pass (dyad/recompute.py)
    working_weights: bool = False  # bf16 copies of the matrices cast once a step (dyad/working_weights.py)
    flash4: bool = True  # FlashAttention-4 where flash-attn-4 is installed; False: SDPA (cuDNN on an H200)


VARIANTS = {  # the global batch is microbatches x sequences sequences of 4,096 tokens
    "bf16-1mb": Variant(1),
    "bf16-8mb": Variant(8),
    "bf16-1mb-compiled": Variant(1, compiled_blocks=True),
    "bf16-8mb-compiled": Variant(8, compiled_blocks=True),
    "bf16-4mb-x2-compiled": Variant(4, sequences=2, compiled_blocks=True),
    "bf16-2mb-x4-compiled": Variant(2, sequences=4, compiled_blocks=True),
    "bf16-8mb-compiled-working-weights": Variant(8, compiled_blocks=True, working_weights=True),
    "bf16-2mb-x4-compiled-working-weights": Variant(2, sequences=4, compiled_blocks=True, working_weights=True),
    "bf16-8mb-working-weights": Variant(8, working_weights=True),
    "bf16-1mb-recompute": Variant(1, recompute=True),
    "bf16-2mb-x4-compiled-recompute": Variant(2, sequences=4, compiled_blocks=True, recompute=True),
    "bf16-1mb-x8-compiled-recompute": Variant(1, sequences=8, compiled_blocks=True, recompute=True),
    "bf16-1mb-x8-compiled-working-weights": Variant(1, sequences=8, compiled_blocks=True, working_weights=True),
    "bf16-2mb-x4-compiled-working-weights-sdpa": Variant(2, sequences=4, compiled_blocks=True, working_weights=True,
                                                         flash4=False),
    "bf16-1mb-x8-compiled-working-weights-sdpa": Variant(1, sequences=8, compiled_blocks=True, working_weights=True,
                                                         flash4=False),
    "fp8-8mb": Variant(8, fp8="eager"),
    "fp8c-8mb": Variant(8, fp8="compiled"),
}


def needs_compiler(name: str) -> bool:
    """Variants that compile (Triton kernels): GPU only; CI's toy run stays eager."""
    variant = VARIANTS[name]
    return variant.compiled_blocks or variant.fp8 == "compiled"


def build(cfg: LLMConfig, device: str, variant: Variant):
    """The model and its optimizer; with working weights the optimizer updates their float32
    masters, and the step refreshes the bf16 copies after each update."""
    torch.manual_seed(0)
    fp8 = variant.fp8
    model = MoELM(cfg)
    if fp8:
        convert_to_fp8(model)
    if fp8 == "compiled":
        compile_quantization()
    model = model.to(device)
    working = WorkingWeights(model) if variant.working_weights else None
    if variant.recompute:
        recompute_blocks(model)
    if variant.compiled_blocks:
        compile_blocks(model)
    train = argparse.Namespace(weight_decay=0.01, beta1=0.9, beta2=0.95, eps=1e-8, lr=1e-4)
    optimizer = build_optimizer(trained_parameters(model), train)
    if working is not None:
        working.refresh_after_each_step(optimizer)
    return model, optimizer


def make_step(model, optimizer, cfg: LLMConfig, S: int, N: int, variant: Variant, device: str):
    """One optimizer step over `variant.microbatches` microbatches of `variant.sequences`
    sequences of S tokens each (gradients accumulated), N image rows spliced into each sequence."""
    M, B = variant.microbatches, variant.sequences
    ids = torch.randint(cfg.vocab_size, (M, B, S), device=device)
    targets = torch.randint(cfg.vocab_size, (M, B, S), device=device)
    positions = (torch.arange(B, device=device)[:, None] * S + torch.arange(8, 8 + N, device=device)).reshape(-1)
    rows = torch.randn(B * N, cfg.dim, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    # bf16 working weights need autocast's bf16 activations, also in the CPU toy run
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda" or variant.working_weights)

    def step():
        FLASH4["enabled"] = variant.flash4
        for m in range(M):
            with autocast:
                logits, aux = model(ids[m], rows, positions)
                loss = (model.loss_sum(logits, targets[m]) / (B * S) + aux) / M
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def attention_kernel(cfg: LLMConfig, device: str, variant: Variant) -> str:
    """Which kernel the variant's attention runs: "flash4" or "sdpa"."""
    q, kv = (torch.empty(1, 1, heads, cfg.head_dim, device=device, dtype=torch.bfloat16)
             for heads in (cfg.n_heads, cfg.n_kv_heads))
    return "flash4" if variant.flash4 and flash4_applies(q, kv, kv) else "sdpa"


def host_share(step, iters: int) -> tuple[float, float]:
    """Medians over `iters` GPU steps of (ms the host takes to issue the step, ms to its end on
    the GPU), each from an idle GPU: when the two are close the step is bound by the host."""
    host, wall = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        host.append((issued - start) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
    return statistics.median(host), statistics.median(wall)


def allocator_numbers() -> dict:
    """What the caching allocator did since the last reset: its peak reservation and how often it
    had to free its cached blocks and retry a cudaMalloc (each retry synchronizes the device)."""
    stats = torch.cuda.memory_stats()
    return {"peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--config", default="1b-active", choices=[c for c in CONFIGS if c != "toy"],
                        help="the model's shape on a GPU (CPU: toy)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--variants", help="comma-separated names from VARIANTS (default: all; on CPU the eager ones)")
    parser.add_argument("--out")
    parser.add_argument("--profile-dir", help="GPU: a kernel table of each variant's step is written here")
    parser.add_argument("--timeline-dir", help="GPU: each variant's kernels in order, with the idle gaps, are written here")
    parser.add_argument("--without-reload-barrier", action="store_true",
                        help="compiled blocks without the barrier before reloads (its cost; gradients can be wrong)")
    args = parser.parse_args()
    if args.without_reload_barrier:
        inductor_reloads.install = lambda: None  # compile_blocks calls it through the module
    device = bench_device(args.toy)
    spec = CONFIGS["toy" if device == "cpu" else args.config]
    cfg, S, N = spec["llm"], spec["seq"], spec["image_rows"]
    active = active_parameters(cfg)
    # attention's width: heads x head_dim, which is the model dim except where head_dim is set apart
    flops_per_token = 6 * active + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * S
    result = {
        **run_header(device), "config": "toy" if device == "cpu" else args.config,
        "reload_barrier": not args.without_reload_barrier,
        "active_params": active, "seq": S, "image_rows": N, "variants": {},
    }
    eager = [name for name in VARIANTS if not needs_compiler(name)]
    names = args.variants.split(",") if args.variants else list(VARIANTS) if device == "cuda" else eager
    for name in names:
        variant = VARIANTS[name]
        model, optimizer = build(cfg, device, variant)
        result["total_params"] = sum(p.numel() for p in model.parameters())
        step = make_step(model, optimizer, cfg, S, N, variant, device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            seconds = median_ms(step, args.iters, device) / 1e3
        except RuntimeError as error:  # one variant failing must not lose the others' numbers
            result["variants"][name] = {"error": str(error)[:2000]}
            print(f"{name:9s} failed: {str(error)[:300]}")
            del model, optimizer, step
            continue
        tokens = S * variant.sequences * variant.microbatches
        tflops = flops_per_token * tokens / seconds / 1e12
        entry = {
            "microbatches": variant.microbatches, "sequences_per_microbatch": variant.sequences,
            "fp8": variant.fp8, "attention": attention_kernel(cfg, device, variant), "step_s": seconds, "tokens_per_step": tokens,
            "tokens_per_s": tokens / seconds, "model_tflops": tflops, "mfu": tflops / PEAK_TFLOPS,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0,
        }
        result["variants"][name] = entry
        print(f"{name:9s} active {active / 1e9:.2f}B of {result['total_params'] / 1e9:.2f}B params, "
              f"{tokens} tokens/step: {seconds * 1e3:.1f} ms/step, {tokens / seconds:,.0f} tok/s, "
              f"{tflops:.0f} TFLOP/s, MFU {tflops / PEAK_TFLOPS:.1%}, peak memory {entry['peak_memory_gb']:.1f} GB")
        if device == "cuda":
            entry.update(allocator_numbers())
            entry["host_issue_ms"], entry["idle_start_ms"] = host_share(step, args.iters)
            print(f"{'':9s} from an idle GPU: host issues the step in {entry['host_issue_ms']:.1f} of "
                  f"{entry['idle_start_ms']:.1f} ms; allocator peak reserved {entry['peak_reserved_gb']:.1f} GB, "
                  f"{entry['alloc_retries']} cudaMalloc retries")
        if args.profile_dir and device == "cuda":
            write_kernel_table(step, f"{args.profile_dir}/llm_step_profile_{name}.txt", steps=2, rows=40)
        if args.timeline_dir and device == "cuda":
            entry["timeline"] = write_timeline(step, f"{args.timeline_dir}/llm_step_timeline_{name}.txt", steps=2)
        del model, optimizer, step
        if device == "cuda":
            torch.cuda.empty_cache()
    write_json(args.out, result)


if __name__ == "__main__":
    main()
