"""Which part of a compiled recomputing LLM block gives wrong gradients on CUDA?"""
import copy, functools, sys
import torch
from torch.utils.checkpoint import checkpoint
from tests.tiny_models import resolved_config
from dyad.service import build_model
from dyad.recompute import recompute_blocks
from dyad.llm_service.model import rotary_cos_sin
torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
import os
dev = os.environ.get("DEV", "cuda")
SMOKE = os.environ.get("SMOKE")
config = resolved_config(["llm.dim=256", "llm.n_heads=4", "llm.n_kv_heads=2", "llm.moe.expert_dim=128"])
torch.manual_seed(0)
base = build_model(config, "llm", dev)
B, S, D = 8, 256, config.llm.dim
g = torch.Generator().manual_seed(0)
h0 = torch.randn(B, S, D, generator=g).to(dev)
wout = torch.randn(B, S, D, generator=g).to(dev)
pos = torch.arange(S, device=dev)
cos, sin = rotary_cos_sin(pos, config.llm.head_dim, config.llm.rope_theta)
seq = torch.arange(B, device=dev).unsqueeze(1).expand(B, S).reshape(-1)

def grads(fn, params):
    for p in params.values(): p.grad = None
    h = h0.clone().requires_grad_()
    with torch.autocast(dev, dtype=torch.bfloat16):
        out = fn(h)
    y, aux = out if isinstance(out, tuple) else (out, None)
    loss = (y.float() * wout[..., :y.shape[-1]].reshape(y.shape)).sum() / y.numel()
    if aux is not None: loss = loss + aux
    loss.backward()
    return {"input": h.grad.clone(), **{n: p.grad.clone() for n, p in params.items() if p.grad is not None}}

def compare(tag, got, ref):
    worst = max(((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() for k in ref)
    bad = [f"{k}:{((got[k]-ref[k]).norm()/ref[k].norm().clamp_min(1e-12)).item():.3f}" for k in ref
           if ((got[k]-ref[k]).norm()/ref[k].norm().clamp_min(1e-12)).item() > 0.02]
    print(f"{tag:40s} worst {worst:.4f} {' '.join(bad[:8])}", flush=True)

for i in (0, 1):
    ref_model = copy.deepcopy(base)
    blk = ref_model.layers[i]
    params = dict(blk.named_parameters())
    call = lambda b: (lambda h: b(h, cos, sin, pos, None, seq))
    ref = grads(call(blk), params)
    for mode in ("eager-recompute", "inductor", "inductor-recompute", "aot_eager-recompute"):
        m = copy.deepcopy(base)
        if "recompute" in mode: recompute_blocks(m)
        b = m.layers[i]
        if mode.startswith("inductor"): b.compile(backend="aot_eager" if SMOKE else "inductor")
        if mode.startswith("aot_eager"): b.compile(backend="aot_eager")
        compare(f"layer {i} ({'moe' if b.is_moe else 'dense'}) {mode}", grads(call(b), dict(b.named_parameters())), ref)
        torch._dynamo.reset()

# The MoE layer, the attention and the norm alone, each checkpointed inside one compiled function.
m = copy.deepcopy(base)
blk = m.layers[1]
parts = {
    "moe": (blk.feed_forward, lambda mod: (lambda h: mod(h.reshape(-1, D), None, seq))),
    "attention": (blk.attention, lambda mod: (lambda h: mod(h, cos, sin, pos))),
}
for name, (mod, call) in parts.items():
    params = dict(mod.named_parameters())
    ref = grads(call(mod), params)
    compiled = torch.compile(call(mod), backend="aot_eager" if SMOKE else "inductor")
    compare(f"{name} inductor", grads(compiled, params), ref)
    torch._dynamo.reset()
    ck = torch.compile(lambda h: checkpoint(call(mod), h, use_reentrant=False), backend="aot_eager" if SMOKE else "inductor")
    compare(f"{name} inductor checkpoint", grads(ck, params), ref)
    torch._dynamo.reset()
