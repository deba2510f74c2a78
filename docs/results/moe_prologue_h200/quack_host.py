"""Where the Mixtral-like layer's idle start goes with QuACK's fused GEMMs (diagnostic, git-excluded):
host time per piece of the forward with the GPU kept busy, QuACK's gemm_act against its EpiPlan.run
and F.grouped_mm, and the step idle / host ahead, fused against the plain path."""
import statistics, sys, time
sys.path.insert(0, "bench")
import torch
import torch.nn.functional as F
import moe_layer as ml
from dyad.kernels import gated_experts as ge
from dyad.kernels.expert_weight_grads import expert_grouped_mm
from dyad.llm_service import moe as moe_mod

dim, hidden, E, K, T = ml.SHAPES["mixtral-like"]
print("quack:", ge._quack() is not None, flush=True)
times = {}


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        r = fn(*a, **k)
        times.setdefault(name, []).append((time.perf_counter() - t) * 1e6)
        return r
    return wrapper


def busy(n=30):
    ml._queue_busy_work(matmuls=n)


layer = ml.dyad_interleaved_layer(dim, hidden, E, K).cuda().to(torch.bfloat16)
x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)


def step(lay):
    y, aux = lay(x)
    torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])


for _ in range(3):
    step(layer)
torch.cuda.synchronize()

# 1) host per piece of the forward, GPU busy
for name in ("router_logits", "softmax_topk", "permute", "unpermute", "assignment_counts"):
    setattr(moe_mod, name, timed(name, getattr(moe_mod, name)))
moe_mod.gated_experts = timed("gated_experts(all)", moe_mod.gated_experts)
qa, qd = ge._quack()
ge._quack = lambda: (timed("quack.gemm_act", qa), timed("quack.gemm_dact", qd))
ge.F = type("Fwrap", (), {"grouped_mm": staticmethod(timed("F.grouped_mm(in gated)", F.grouped_mm)),
                          "pad": staticmethod(F.pad)})
fwd = []
for _ in range(20):
    torch.cuda.synchronize()
    busy()
    t = time.perf_counter()
    y, aux = layer(x)
    fwd.append((time.perf_counter() - t) * 1e6)
    torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])
torch.cuda.synchronize()
print(f"forward host us (GPU busy): median {statistics.median(fwd):.0f}")
for name, v in times.items():
    print(f"  {name:28s} median {statistics.median(v):8.1f} us  (n={len(v)})")

# 2) gemm_act vs EpiPlan.run vs F.grouped_mm, host only
xs = torch.randn(T * K, dim, device="cuda", dtype=torch.bfloat16)
offs = torch.tensor([(i + 1) * T * K // E for i in range(E)], device="cuda", dtype=torch.int32)
starts = F.pad(offs, (1, 0))
w13 = layer.w13_ED2F.detach().to(torch.bfloat16)
w2 = layer.w2_EFD.detach().to(torch.bfloat16)


def host_us(fn, n=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    busy(40)
    s = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        s.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(s)


print("gemm_act host us:", round(host_us(lambda: qa(xs, w13, activation="swiglu", cu_seqlens_m=starts, tuned=False)), 1))
print("F.grouped_mm host us:", round(host_us(lambda: F.grouped_mm(xs, w13, offs=offs)), 1))
try:
    from quack.epilogue.library import linear_act_mod
    mod = linear_act_mod("swiglu", gated=True, has_c=False, has_rowvec=False, has_colvec=False)
    pre = torch.empty(T * K, 2 * hidden, device="cuda", dtype=torch.bfloat16)
    post = torch.empty(T * K, hidden, device="cuda", dtype=torch.bfloat16)
    print("mod() host us:", round(host_us(lambda: mod(xs, w13, None, out={"D": pre, "mAuxOut": post}, tuned=False,
                                                     cu_seqlens_m=starts)), 1))
    plan = mod.plan(xs, w13, None, out={"D": pre, "mAuxOut": post}, cu_seqlens_m=starts)
    print("plan.run host us:", round(host_us(lambda: plan.run(xs, w13, None, out={"D": pre, "mAuxOut": post},
                                                              cu_seqlens_m=starts)), 1))
    ref_pre, ref_post = qa(xs, w13, activation="swiglu", cu_seqlens_m=starts, tuned=False)
    plan.run(xs, w13, None, out={"D": pre, "mAuxOut": post}, cu_seqlens_m=starts)
    torch.cuda.synchronize()
    print("plan.run equal to gemm_act:", torch.equal(ref_pre, pre), torch.equal(ref_post, post))
    print("empty x2 host us:", round(host_us(lambda: (torch.empty_like(pre), torch.empty_like(post))), 1))
except Exception as ex:  # noqa: BLE001
    print("plan probe failed:", type(ex).__name__, str(ex)[:500])

# 3) idle vs ahead, fused vs plain
ge._quack = lambda: (qa, qd)
ge.F = F
plain = ml.dyad_interleaved_layer(dim, hidden, E, K).cuda().to(torch.bfloat16)
plain.expert_matmul = lambda *a: expert_grouped_mm(*a)  # not the same object: the plain path
steps = {"fused": lambda: step(layer), "plain": lambda: step(plain)}
for hs in (False, True):
    r = ml.time_interleaved(steps, 20, "cuda", head_start=hs)
    print("host ahead" if hs else "idle", {k: round(v, 2) for k, v in r.items()})
