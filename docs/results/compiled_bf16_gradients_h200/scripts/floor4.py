"""Compiled cuDNN attention against eager: the model's blocks and SDPA alone."""
import contextlib, os, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, os.path.dirname(__file__))
from floor2 import setup, run, report
B_ = SDPBackend
base, inputs = setup()
truth = run(base, inputs, False)
for tag, backends in [("flash", [B_.FLASH_ATTENTION]), ("math", [B_.MATH]), ("cudnn", [B_.CUDNN_ATTENTION]),
                      ("default", None)]:
    with (sdpa_kernel(backends) if backends else contextlib.nullcontext()):
        report(f"bf16 compiled both, {tag}", run(base, inputs, True, (0, 1)), truth)

# SDPA alone: two "layers" of x -> proj -> attention, each its own compiled function.
torch.manual_seed(0)
Bsz, S, H, G, Dh = 8, 256, 4, 2, 64
D = H * Dh
ws = [[torch.randn(D, n * Dh, device="cuda") * D**-0.5 for n in (H, G, G)] + [torch.randn(D, D, device="cuda") * D**-0.5]
      for _ in range(2)]
for w in ws:
    for t in w: t.requires_grad_()
x0 = torch.randn(Bsz, S, D, device="cuda")

def layer(x, wq, wk, wv, wo):
    q = (x @ wq).view(Bsz, S, H, Dh).transpose(1, 2)
    k = (x @ wk).view(Bsz, S, G, Dh).transpose(1, 2)
    v = (x @ wv).view(Bsz, S, G, Dh).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return x + o.transpose(1, 2).reshape(Bsz, S, D) @ wo

def grads(fns, autocast=True):
    for w in ws:
        for t in w: t.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        h = x0
        for fn, w in zip(fns, ws):
            h = fn(h, *w)
    (h.float() ** 2).mean().backward()
    return [t.grad.clone() for w in ws for t in w]

def err(a, b):
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))

ref32 = grads([layer, layer], autocast=False)
print("sdpa alone: eager bf16 vs fp32", f"{err(grads([layer, layer]), ref32):.2e}")
for name, fns in [("both compiled", [torch.compile(layer), torch.compile(layer)]),
                  ("first compiled", [torch.compile(layer), layer]),
                  ("second compiled", [layer, torch.compile(layer)])]:
    grads(fns)
    print(f"sdpa alone: {name} bf16 vs fp32", f"{err(grads(fns), ref32):.2e}", f"again {err(grads(fns), ref32):.2e}", flush=True)
    torch._dynamo.reset()
