"""Is cuDNN attention behind the compiled bf16 gradients' error?"""
import contextlib, copy, os, sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, os.path.dirname(__file__))
from floor2 import setup, run, report
base, inputs = setup()
truth = run(base, inputs, False)

def backends_used(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    names = {e.name for e in p.events() if any(s in e.name.lower() for s in ("cudnn", "flash", "fmha", "sdpa", "attention", "mha"))}
    return sorted(n[:70] for n in names)

B = SDPBackend
cases = [
    ("eager default", None, ()),
    ("eager cudnn", [B.CUDNN_ATTENTION], ()),
    ("eager flash", [B.FLASH_ATTENTION], ()),
    ("eager efficient", [B.EFFICIENT_ATTENTION], ()),
    ("compiled default", None, (0, 1)),
    ("compiled flash/efficient (no cudnn)", [B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION], (0, 1)),
    ("compiled cudnn", [B.CUDNN_ATTENTION], (0, 1)),
    ("compiled default, again", None, (0, 1)),
]
for tag, backends, layers in cases:
    ctx = sdpa_kernel(backends) if backends else contextlib.nullcontext()
    with ctx:
        got = run(base, inputs, True, layers)
        report(f"bf16 {tag}", got, truth)
        if not layers:
            print("   kernels:", backends_used(lambda: run(base, inputs, True, layers)), flush=True)
