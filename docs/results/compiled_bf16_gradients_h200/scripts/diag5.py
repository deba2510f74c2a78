"""Fingerprint every argument and result of the compiled graphs' runtime calls (AOTAutograd's
call_func_at_runtime_with_args), in a wrong run (every block compiled) and a right one (the
same, with each block's input cloned first): which argument of the MoE block's backward differs,
and do any of its arguments share memory?"""
import copy, sys
sys.path.insert(0, "bench"); sys.path.insert(0, "scratch_gpu")
import torch
from torch import nn
import torch._dynamo  # noqa: F401 (before runtime_wrappers: circular import)
import torch._functorch._aot_autograd.runtime_wrappers as rw
import compiled_gradients as cg

CALLS = []
_orig = rw.call_func_at_runtime_with_args


def fingerprint(t):
    if not isinstance(t, torch.Tensor):
        return None
    s = t.untyped_storage()
    return dict(shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""), sum=t.detach().double().abs().sum().item(),
                lo=s.data_ptr(), hi=s.data_ptr() + s.nbytes(), ptr=t.data_ptr(), stride=t.stride(),
                offset=t.storage_offset(), nbytes=s.nbytes(), cpu=t.detach().cpu().clone())


def recording(f, args, steal_args=False, disable_amp=False):
    before = [fingerprint(a) for a in args]
    out = _orig(f, args, steal_args, disable_amp)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    CALLS.append((before, [fingerprint(o) for o in (out if isinstance(out, (list, tuple)) else [out])]))
    return out


class Clone(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block, self.is_moe = block, block.is_moe

    def forward(self, h, *rest):
        return self.block(h.clone(), *rest)


def run(clone):
    CALLS.clear()
    base, inputs = cg.build("cuda", cg.SIZES["gpu"])
    model = copy.deepcopy(base)
    for i, block in enumerate(model.layers):
        block.compile(backend="inductor")
        if clone:
            model.layers[i] = Clone(block)
    rw.call_func_at_runtime_with_args = recording
    try:
        cg.gradients(model, inputs, bf16=True, passes=2)
    finally:
        rw.call_func_at_runtime_with_args = _orig
    torch._dynamo.reset()
    print(f"{len(CALLS)} calls recorded, arg counts {[len(c[0]) for c in CALLS]}")
    return list(CALLS[len(CALLS) // 2:])  # the second pass


def overlaps(prints):
    found = []
    for i, a in enumerate(prints):
        for j, b in enumerate(prints[:i]):
            if a and b and a["lo"] < b["hi"] and b["lo"] < a["hi"]:
                found.append((j, i))
    return found


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    bad, good = run(False), run(True)
    for k, ((bad_in, bad_out), (good_in, good_out)) in enumerate(zip(bad, good)):
        name = f"call {k}"
        print(f"== {name}: {len(bad_in)} args, {len(bad_out)} results; args sharing memory wrong run {overlaps(bad_in)} right run {overlaps(good_in)}")
        print(f"   results sharing memory with args (wrong run): {[(i, j) for i, a in enumerate(bad_in) for j, o in enumerate(bad_out) if a and o and a['lo'] < o['hi'] and o['lo'] < a['hi']]}")
        for label, xs, ys in (("arg", bad_in, good_in), ("result", bad_out, good_out)):
            for i, (x, y) in enumerate(zip(xs, ys)):
                if x is None or y is None:
                    continue
                d = abs(x["sum"] - y["sum"]) / max(abs(y["sum"]), 1e-30)
                layout = lambda z: (z["stride"], z["offset"], z["ptr"] % 16, z["nbytes"])
                if label == "arg" and layout(x) != layout(y):
                    print(f"   arg {i} {x['shape']} {x['dtype']} layout (stride, offset, ptr%16, storage bytes) wrong {layout(x)} right {layout(y)}")
                if label == "arg" and x["cpu"].shape == y["cpu"].shape:
                    a, b = x["cpu"].double(), y["cpu"].double()
                    c = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                    if c > 0.05:
                        print(f"   arg {i} {x['shape']} {x['dtype']}: contents differ, relative {c:.2e}")
                if d > 1e-2:
                    print(f"   {label} {i} {x['shape']} {x['dtype']}: |sum| wrong {x['sum']:.4e} right {y['sum']:.4e}")
    print("done")


if __name__ == "__main__":
    main()
