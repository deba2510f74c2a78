import sys, torch
from tests.test_recompute import _both_models, _loss_and_grads, _llm_loss
from tests.tiny_models import resolved_config
from dyad.compile import compile_blocks
backend, device = sys.argv[1], sys.argv[2]
config = resolved_config(["llm.dim=256", "llm.n_heads=4", "llm.n_kv_heads=2", "llm.moe.expert_dim=128"])
plain, recomputing = _both_models(config, "llm", device)
if backend != "none":
    compile_blocks(plain, backend); compile_blocks(recomputing, backend)
g = torch.Generator().manual_seed(0)
ids = torch.randint(config.llm.vocab_size, (8, 256), generator=g).to(device)
rows = torch.randn(64, config.llm.dim, generator=g).to(device)
inputs = (ids, rows, torch.arange(64, device=device))
res = []
for m in (plain, recomputing):
    _loss_and_grads(m, _llm_loss, inputs, True)
    res.append(_loss_and_grads(m, _llm_loss, inputs, True))
(l, g0), (lr, g1) = res
print(backend, device, "loss", float(l), float(lr))
for n, gr in g0.items():
    e = (g1[n] - gr).norm() / gr.norm().clamp_min(1e-12)
    if e > 0.01: print("  ", n, float(e), float(gr.norm()), float(g1[n].norm()))
print("done")
