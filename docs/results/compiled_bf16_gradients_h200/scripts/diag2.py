"""Is the MoE block's saved input (the dense block's output) overwritten or freed before its backward?"""
import copy, sys, time
sys.path.insert(0, "bench"); sys.path.insert(0, "scratch_gpu")
import torch
from torch import nn
import compiled_gradients as cg
from diag import grads_of, rel


class Probe(nn.Module):
    def __init__(self, block, store, key, clone_input, hold):
        super().__init__()
        self.block, self.store, self.key, self.clone_input, self.hold = block, store, key, clone_input, hold
        self.is_moe = block.is_moe

    def forward(self, h, *rest):
        if self.clone_input:
            h = h.clone()
        kept = h.detach().clone()
        out, aux = self.block(h, *rest)
        self.store[f"{self.key}.out"] = out.detach().float().clone()
        ptr = h.untyped_storage().data_ptr()
        out.register_hook(self.before_backward(h if self.hold else None, kept, ptr))
        return out, aux

    def before_backward(self, h, kept, ptr):
        def check(g):
            torch.cuda.synchronize()
            changed = float("nan") if h is None else (h.detach() - kept).abs().max().item()
            fresh = [torch.empty_like(kept) for _ in range(6)]
            reused = [t.data_ptr() == ptr for t in fresh]
            stats = torch.cuda.memory_stats()
            print(f"    {self.key} before its backward: input changed by {changed:.3e}, input storage ptr {ptr:#x}, "
                  f"handed out again by the allocator: {any(reused)} "
                  f"active {stats['active_bytes.all.current']/2**20:.0f} MiB", flush=True)
            self.store[f"{self.key}.grad_out"] = g.detach().float().clone()
            del fresh
        return check


def probed(base, compile_blocks, clone_input=False, hold=True):
    model = copy.deepcopy(base)
    store = {}
    for i, block in enumerate(model.layers):
        if compile_blocks:
            block.compile(backend="inductor")
        model.layers[i] = Probe(block, store, f"L{i}", clone_input, hold)
    return model, store


def run(name, base, inputs, truth_g, compile_blocks=True, clone_input=False, hold=True):
    t0 = time.time()
    print(f"{name}:", flush=True)
    model, store = probed(base, compile_blocks, clone_input, hold)
    cg.gradients(model, inputs, bf16=True, passes=2)
    g = grads_of(model)
    torch._dynamo.reset()
    errs = {n: rel(g[n], truth_g[n]) for n in truth_g}
    print(f"  [{time.time()-t0:.0f}s] " + " ".join(f"{n.replace('layers.', 'L').replace('feed_forward.', 'ff.').replace('attention.', 'a.').replace('.weight', '')}={e:.1e}" for n, e in errs.items()), flush=True)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    base, inputs = cg.build("cuda", cg.SIZES["gpu"])
    model, _ = probed(base, False)
    cg.gradients(model, inputs, bf16=False)
    truth_g = grads_of(model)
    run("eager", base, inputs, truth_g, compile_blocks=False)
    run("compiled, the probe holding each block's input", base, inputs, truth_g)
    run("compiled, the probe holding only the input's address", base, inputs, truth_g, hold=False)
    run("compiled, each block's input cloned first", base, inputs, truth_g, clone_input=True)
    torch.use_deterministic_algorithms(True)
    run("compiled, deterministic algorithms, address only", base, inputs, truth_g, hold=False)
    torch.use_deterministic_algorithms(False)


if __name__ == "__main__":
    main()
