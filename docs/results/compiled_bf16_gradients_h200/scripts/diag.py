"""Where do compiled bf16 gradients go wrong? Block-boundary activations and gradients, and
patched variants (each a fresh copy of the model, dynamo reset)."""
import contextlib, copy, sys, time
sys.path.insert(0, "bench")
import torch
from torch import nn
import compiled_gradients as cg
import dyad.kernels.moe_permute as mp
import dyad.kernels.token_rows as tr
import dyad.kernels.grouped_mm as gm
import dyad.llm_service.moe as moe


class Probe(nn.Module):
    def __init__(self, block, store, key, sync):
        super().__init__()
        self.block, self.store, self.key, self.sync = block, store, key, sync
        self.is_moe = block.is_moe

    def forward(self, h, *rest):
        if self.sync:
            torch.cuda.synchronize()
        if self.key == "L0" and h.requires_grad:
            h.register_hook(self.hook("L0.grad_in"))
        out, aux = self.block(h, *rest)
        if self.sync:
            torch.cuda.synchronize()
        self.store[f"{self.key}.out"] = out.detach().float().clone()
        out.register_hook(self.hook(f"{self.key}.grad_out"))
        return out, aux

    def hook(self, name):
        def save(g):
            if self.sync:
                torch.cuda.synchronize()
            self.store[name] = g.detach().float().clone()
        return save


def probed(base, compile_blocks, sync=False, backend="inductor"):
    model = copy.deepcopy(base)
    store = {}
    for i, block in enumerate(model.layers):
        if compile_blocks:
            block.compile(backend=backend)
        model.layers[i] = Probe(block, store, f"L{i}", sync)
    return model, store


def grads_of(model):
    return {n.replace(".block.", "."): p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def argsort_inverse(order_N):
    return torch.argsort(order_N)


def argsort_order(positions_TK):
    return torch.argsort(positions_TK.reshape(-1))


def onehot_counts(flat_expert_N, num_experts):
    return torch.nn.functional.one_hot(flat_expert_N, num_experts).sum(0)


def onehot_assignment_counts(expert_idx_TK, valid_T, num_experts):
    return torch.nn.functional.one_hot(expert_idx_TK.reshape(-1), num_experts).sum(0)


VARIANTS = {
    "compiled": lambda: contextlib.nullcontext(),
    "compiled-synced": lambda: contextlib.nullcontext(),
    "argsort-inverse": lambda: contextlib.ExitStack(),
    "onehot-counts": lambda: contextlib.ExitStack(),
    "loop-grouped-mm": lambda: patched(gm, "_FAST_KERNEL", None),
}


def variant_context(name):
    stack = contextlib.ExitStack()
    if name == "argsort-inverse":
        stack.enter_context(patched(mp, "inverse_permutation", argsort_inverse))
        stack.enter_context(patched(tr, "_order", argsort_order))
    if name == "onehot-counts":
        stack.enter_context(patched(mp, "expert_counts", onehot_counts))
        stack.enter_context(patched(moe, "expert_counts", onehot_counts))
        stack.enter_context(patched(moe, "assignment_counts", onehot_assignment_counts))
    if name == "loop-grouped-mm":
        stack.enter_context(patched(gm, "_FAST_KERNEL", None))
    if name == "argsort+onehot":
        stack.enter_context(patched(mp, "inverse_permutation", argsort_inverse))
        stack.enter_context(patched(tr, "_order", argsort_order))
        stack.enter_context(patched(mp, "expert_counts", onehot_counts))
        stack.enter_context(patched(moe, "expert_counts", onehot_counts))
        stack.enter_context(patched(moe, "assignment_counts", onehot_assignment_counts))
    return stack


def run(name, base, inputs, truth_g, truth_s, bf16=True, passes=2):
    t0 = time.time()
    model, store = probed(base, name != "eager", sync=name == "compiled-synced")
    with variant_context(name):
        grads = [cg.gradients(model, inputs, bf16=bf16, passes=p) and grads_of(model) for p in (passes, 1)]
    torch._dynamo.reset()
    g, g_again = grads
    errs = {n: rel(g[n], truth_g[n]) for n in truth_g}
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:4]
    vals = sorted(errs.values())
    stages = " ".join(f"{k}={rel(store[k], truth_s[k]):.1e}" for k in sorted(truth_s))
    again = max(rel(g_again[n], g[n]) for n in g)
    print(f"{name:18s} worst {worst[0][1]:.2e} median {vals[len(vals)//2]:.2e} next-pass-diff {again:.1e} "
          f"[{time.time()-t0:.0f}s]\n    {' '.join(f'{n}={e:.1e}' for n, e in worst)}\n    stages: {stages}", flush=True)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    base, inputs = cg.build("cuda", cg.SIZES["gpu"])
    model, truth_s = probed(base, False)
    cg.gradients(model, inputs, bf16=False)
    truth_g = grads_of(model)
    print("stage norms:", {k: f"{v.norm():.2e}" for k, v in sorted(truth_s.items())})
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["eager", "compiled", "compiled-synced", "argsort-inverse",
                                                              "onehot-counts", "loop-grouped-mm", "argsort+onehot"]
    for name in names:
        try:
            run(name, base, inputs, truth_g, truth_s)
        except Exception as error:  # keep going: one device call
            print(f"{name}: FAILED {type(error).__name__}: {str(error)[:400]}", flush=True)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
