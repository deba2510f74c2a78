"""Compiled bf16 gradients of the tiny LLM against eager float32: which setting brings them back?"""
import copy, os, sys
import torch
from tests.test_recompute import _llm_loss, _loss_and_grads
from tests.tiny_models import resolved_config
from dyad.service import build_model
dev = os.environ.get("DEV", "cuda")
backend = os.environ.get("BACKEND", "inductor")
OVR = ["llm.dim=256", "llm.n_heads=4", "llm.n_kv_heads=2", "llm.moe.expert_dim=128"]

def setup(extra=()):
    config = resolved_config(OVR + list(extra))
    torch.manual_seed(0)
    base = build_model(config, "llm", dev)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(config.llm.vocab_size, (8, 256), generator=g).to(dev)
    rows = torch.randn(64, config.llm.dim, generator=g).to(dev)
    return base, (ids, rows, torch.arange(64, device=dev))

def run(base, inputs, autocast, compile_layers=()):
    m = copy.deepcopy(base)
    for i in compile_layers: m.layers[i].compile(backend=backend)
    _loss_and_grads(m, _llm_loss, inputs, autocast)
    out = _loss_and_grads(m, _llm_loss, inputs, autocast)
    torch._dynamo.reset()
    return out

def report(tag, got, ref):
    (l, g0), (l1, g1) = ref, got
    errs = {n: ((g1[n].float() - g0[n].float()).norm() / g0[n].float().norm().clamp_min(1e-12)).item() for n in g0}
    worst = max(errs, key=errs.get)
    top = sorted(errs.items(), key=lambda kv: -kv[1])[:4]
    print(f"{tag:50s} worst {errs[worst]:.2e} median {sorted(errs.values())[len(errs)//2]:.2e}  "
          + " ".join(f"{k}={v:.1e}" for k, v in top), flush=True)

which = sys.argv[1:]
if __name__ != "__main__": which = []
if __name__ == "__main__":
    base, inputs = setup()
    truth = run(base, inputs, False)
if "main" in which:
    report("bf16 eager", run(base, inputs, True), truth)
    report("bf16 compiled", run(base, inputs, True, (0, 1)), truth)
    report("bf16 compiled again", run(base, inputs, True, (0, 1)), truth)
    report("bf16 only layer 0 (dense) compiled", run(base, inputs, True, (0,)), truth)
    report("bf16 only layer 1 (moe) compiled", run(base, inputs, True, (1,)), truth)
    import torch._inductor.config as ic
    with ic.patch(emulate_precision_casts=True):
        report("bf16 compiled, emulate_precision_casts", run(base, inputs, True, (0, 1)), truth)
    with ic.patch(split_reductions=False):
        report("bf16 compiled, no split reductions", run(base, inputs, True, (0, 1)), truth)
    torch.use_deterministic_algorithms(True)
    report("bf16 compiled, deterministic algorithms", run(base, inputs, True, (0, 1)), truth)
    torch.use_deterministic_algorithms(False)
    b2, i2 = setup(["llm.moe.aux_loss_coef=0"])
    t2 = run(b2, i2, False)
    report("aux_loss_coef=0: bf16 eager", run(b2, i2, True), t2)
    report("aux_loss_coef=0: bf16 compiled", run(b2, i2, True, (0, 1)), t2)
if "dump" in which:
    report("bf16 compiled (dumped)", run(base, inputs, True, (0, 1)), truth)
