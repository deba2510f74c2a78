"""The full tiny LLM of test_compiled_recomputing_blocks_on_a_gpu_match_and_use_less_memory:
how far apart are gradients that differ only by rounding (bf16), and in float32?"""
import copy, os, sys
import torch
from tests.test_recompute import _llm_loss, _loss_and_grads
from tests.tiny_models import resolved_config
from dyad.service import build_model
from dyad.recompute import recompute_blocks
from dyad.compile import compile_blocks
dev = os.environ.get("DEV", "cuda")
backend = os.environ.get("BACKEND", "inductor")
config = resolved_config(["llm.dim=256", "llm.n_heads=4", "llm.n_kv_heads=2", "llm.moe.expert_dim=128"])
torch.manual_seed(0)
base = build_model(config, "llm", dev)
g = torch.Generator().manual_seed(0)
ids = torch.randint(config.llm.vocab_size, (8, 256), generator=g).to(dev)
rows = torch.randn(64, config.llm.dim, generator=g).to(dev)
inputs = (ids, rows, torch.arange(64, device=dev))
nudged = (ids, rows * (1 + 1e-3 * torch.randn(rows.shape, generator=g).to(dev)), inputs[2])

def variant(mode, autocast, x=inputs):
    m = copy.deepcopy(base)
    if "recompute" in mode: recompute_blocks(m)
    if "compiled" in mode: compile_blocks(m, backend)
    _loss_and_grads(m, _llm_loss, x, autocast)
    out = _loss_and_grads(m, _llm_loss, x, autocast)
    torch._dynamo.reset()
    return out

def report(tag, got, ref):
    (l, g0), (l1, g1) = ref, got
    errs = {n: ((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-12)).item() for n in g0}
    worst = max(errs, key=errs.get)
    print(f"{tag:45s} loss {l1.item():.6f} vs {l.item():.6f}  worst {worst} {errs[worst]:.2e}  "
          f"tok_embeddings {errs['tok_embeddings.weight']:.2e}  median {sorted(errs.values())[len(errs)//2]:.2e}", flush=True)

for autocast in (True, False):
    dt = "bf16" if autocast else "fp32"
    eager = variant("eager", autocast)
    report(f"{dt} eager, rows nudged 1e-3", variant("eager", autocast, nudged), eager)
    report(f"{dt} eager recompute", variant("eager-recompute", autocast), eager)
    plain = variant("compiled", autocast)
    report(f"{dt} compiled", plain, eager)
    rec = variant("compiled-recompute", autocast)
    report(f"{dt} compiled recompute", rec, eager)
    report(f"{dt} compiled recompute vs compiled", rec, plain)
