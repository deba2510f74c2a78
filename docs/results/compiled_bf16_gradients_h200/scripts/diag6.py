"""Replay the MoE block's compiled backward (the 47-argument call) on copies of its own
arguments: do identical inputs give identical results? If not, which intermediate buffer first
differs (inductor's intermediate hooks)? argv[1] == "hooks" turns the hooks on."""
import sys
sys.path.insert(0, "bench"); sys.path.insert(0, "scratch_gpu")
import torch
import torch._dynamo  # noqa: F401
import torch._inductor.config as ic
import torch._inductor.hooks as hooks
import torch._functorch._aot_autograd.runtime_wrappers as rw
import compiled_gradients as cg

HOOKS = sys.argv[1:] == ["hooks"]
ic.generate_intermediate_hooks = HOOKS
_orig = rw.call_func_at_runtime_with_args
state = {"n": 0}


def copies(args):
    return [torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device).copy_(a)
            if isinstance(a, torch.Tensor) else a for a in args]


def replay(f, args):
    seen = {}
    def keep(name, val):
        if isinstance(val, torch.Tensor):
            seen[name] = val.detach().clone()
    with hooks.intermediate_hook(keep):
        out = _orig(f, copies(args), True, False)
    torch.cuda.synchronize()
    return [o.detach().clone() if isinstance(o, torch.Tensor) else None for o in out], seen


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def recording(f, args, steal_args=False, disable_amp=False):
    if len(args) != 47:
        return _orig(f, args, steal_args, disable_amp)
    state["n"] += 1
    torch.cuda.synchronize()
    runs = [replay(f, args) for _ in range(3)]
    out = _orig(f, args, steal_args, disable_amp)
    torch.cuda.synchronize()
    real = [o.detach().clone() if isinstance(o, torch.Tensor) else None for o in out]
    print(f"backward call {state['n']}: result 0 |sum| real {real[0].abs().sum():.4e} replays "
          + " ".join(f"{r[0][0].abs().sum():.4e}" for r in runs), flush=True)
    for i in range(len(real)):
        if real[i] is not None:
            d = [rel(r[0][i], runs[0][0][i]) for r in runs[1:]] + [rel(real[i], runs[0][0][i])]
            if max(d) > 1e-3:
                print(f"   result {i} {tuple(real[i].shape)}: replay2/replay3/real vs replay1 {' '.join(f'{x:.1e}' for x in d)}")
    if HOOKS:
        (_, a), (_, b) = runs[0], runs[1]
        print(f"   {len(a)} intermediates; those differing between replays 1 and 2, in order:")
        shown = 0
        for name in a:
            if name in b and a[name].shape == b[name].shape and a[name].is_floating_point():
                d = rel(a[name], b[name])
                if d > 1e-3 and shown < 25:
                    print(f"     {name} {tuple(a[name].shape)} {a[name].dtype} {d:.2e}")
                    shown += 1
    return out


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    base, inputs = cg.build("cuda", cg.SIZES["gpu"])
    for block in base.layers:
        block.compile(backend="inductor")
    rw.call_func_at_runtime_with_args = recording
    cg.gradients(base, inputs, bf16=True, passes=3)
    print("done")


if __name__ == "__main__":
    main()
