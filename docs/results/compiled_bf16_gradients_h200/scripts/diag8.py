"""The kernel whose outputs differ between replays (the MoE block backward's fused ffn-norm
backward, `..._index_select_sum_view_12`): relaunch it alone on the same inputs with its output
buffers pre-filled with different values. If its results depend on what its first output held
before, its second loop reads that output before the first loop's stores are visible to it."""
import sys
sys.path.insert(0, "bench"); sys.path.insert(0, "scratch_gpu")
import torch
import diag7
from diag7 import _orig, backward_module, copies, sync

TARGET = "index_select_sum_view"
state = {"done": False}


def relaunches(obj, args, kwargs):
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    outs = tensors[-3:]  # out_ptr0 (the buffer the second loop reloads), out_ptr2, out_ptr3
    print(f"   kernel {TARGET}: {len(tensors)} tensor args, outputs at {outs}, "
          f"launch configs {[getattr(l, 'config', None) for l in getattr(obj, 'launchers', [])][:2]}", flush=True)
    results = []
    for fill0, fill_rest in ((0.0, 0.0), (0.0, 0.0), (1e4, 0.0), (-1e4, 0.0), (0.0, 1e4)):
        a = list(copies(args))
        a[outs[0]].fill_(fill0)
        for i in outs[1:]:
            a[i].fill_(fill_rest)
        sync()
        obj.run(*a, **kwargs)
        sync()
        results.append([a[i].double().clone() for i in outs])
    base = results[0]
    for (fill0, fill_rest), r in zip(((0, 0), (0, 0), (1e4, 0), (-1e4, 0), (0, 1e4)), results):
        diffs = [((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(r, base)]
        print(f"   out_ptr0 pre-filled {fill0:g}, other outputs {fill_rest:g}: outputs vs first launch {' '.join(f'{d:.2e}' for d in diffs)}", flush=True)


def recording(f, args, steal_args=False, disable_amp=False):
    if len(args) < 40 or state["done"]:
        return _orig(f, args, steal_args, disable_amp)
    state["done"] = True
    mod = backward_module(len(args))
    names = [n for n in vars(mod) if n.startswith("triton_") and TARGET in n]
    obj = getattr(mod, names[0])
    captured = {}
    orig_run = obj.run
    def run(*a, **k):
        captured["args"] = copies(a)
        captured["kwargs"] = dict(k)
        return orig_run(*a, **k)
    obj.run = run
    try:
        out = _orig(f, copies(args), True, False)
    finally:
        obj.run = orig_run
    sync()
    print(f"backward ({len(args)} args): kernel {names[0]}", flush=True)
    relaunches(obj, captured["args"], captured["kwargs"])
    return _orig(f, args, steal_args, disable_amp)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    base, inputs = diag7.cg.build("cuda", diag7.cg.SIZES["gpu"])
    for block in base.layers:
        block.compile(backend="inductor")
    diag7.rw.call_func_at_runtime_with_args = recording
    diag7.cg.gradients(base, inputs, bf16=True, passes=2)
    print("done")


if __name__ == "__main__":
    main()
