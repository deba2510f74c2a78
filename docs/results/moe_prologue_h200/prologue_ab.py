"""A/B of the MoE layer's prologue changes (diagnostic, git-excluded): the one-launch plan's GPU time
against the plain ops, the forward's host time per piece, and the Mixtral-like step idle / host
ahead with both changes, with the old plan and gemm_act (before), and on the plain path."""
import statistics, sys, time
sys.path.insert(0, "bench")
import torch
import torch.nn.functional as F
import moe_layer as ml
from dyad.kernels import gated_experts as ge
from dyad.kernels import moe_permute as mp
from dyad.kernels.expert_weight_grads import expert_grouped_mm
from dyad.llm_service import moe as moe_mod

print("quack:", ge._quack() is not None, flush=True)


def gpu_us(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        ml._queue_busy_work(matmuls=1)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)


def host_us(fn, n=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ml._queue_busy_work(matmuls=40)
    s = []
    for _ in range(n):
        t = time.perf_counter(); fn(); s.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(s)


def old_plan(ids, E):
    return mp.stable_expert_order(ids, E), mp.expert_counts(ids, E)


new_plan = mp.expert_plan
for name, N, E in (("mixtral-like", 16384, 8), ("qwen3-like", 131072, 128)):
    ids = torch.randint(0, E, (N,), device="cuda")
    ref = old_plan(ids, E)
    line = [f"{name}: old plan gpu {gpu_us(lambda: old_plan(ids, E)):.1f} us host {host_us(lambda: old_plan(ids, E)):.1f} us"]
    for block in (1024, 2048, 4096, 8192):
        mp._PLAN_BLOCK = block
        got = new_plan(ids, E)
        ok = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        line.append(f"B{block} gpu {gpu_us(lambda: new_plan(ids, E)):.1f} host {host_us(lambda: new_plan(ids, E)):.1f} eq {ok}")
    print(" | ".join(line), flush=True)
mp._PLAN_BLOCK = int(sys.argv[1]) if len(sys.argv) > 1 else 4096

dim, hidden, E, K, T = ml.SHAPES["mixtral-like"]
x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)


def step(lay):
    y, aux = lay(x)
    torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])


class Before(moe_mod.MoELayer):
    """The layer before: the plan's plain ops and QuACK's gemm_act."""

    def forward(self, *a, **k):
        mp.expert_plan, ge.gated_up_projection = old_plan, before_up
        try:
            return super().forward(*a, **k)
        finally:
            mp.expert_plan, ge.gated_up_projection = new_plan, new_up


new_up = ge.gated_up_projection


def before_up(x_ND, w13, starts, autotune=False):
    return ge._quack()[0](x_ND, w13, activation="swiglu", cu_seqlens_m=starts, tuned=autotune)


layers = {
    "after": ml.dyad_interleaved_layer(dim, hidden, E, K),
    "before": ml.dyad_layer(dim, hidden, E, K, Before, gate_up="interleaved"),
    "plain": ml.dyad_interleaved_layer(dim, hidden, E, K),
}
layers = {k: v.cuda().to(torch.bfloat16) for k, v in layers.items()}
layers["plain"].expert_matmul = lambda *a: expert_grouped_mm(*a)
for lay in layers.values():
    torch.manual_seed(0)
    for p in lay.parameters():
        torch.nn.init.normal_(p, std=0.02)
outs = {}
for k, lay in layers.items():
    x.grad = None
    y, aux = lay(x)
    torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])
    outs[k] = (y.detach().clone(), x.grad.clone(), lay.w13_ED2F.grad.clone())
print("after == before (y, dx, dw13):", [torch.equal(a, b) for a, b in zip(outs["after"], outs["before"])], flush=True)

for k, lay in layers.items():
    fwd = []
    for _ in range(20):
        torch.cuda.synchronize()
        ml._queue_busy_work(matmuls=30)
        t = time.perf_counter()
        y, aux = lay(x)
        fwd.append((time.perf_counter() - t) * 1e6)
        torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])
    torch.cuda.synchronize()
    print(f"{k}: forward host us (GPU busy) median {statistics.median(fwd):.0f}", flush=True)

steps = {k: (lambda lay=lay: step(lay)) for k, lay in layers.items()}
for rnd in range(2):
    for hs in (False, True):
        r = ml.time_interleaved(steps, 20, "cuda", head_start=hs)
        print(f"round {rnd}", "host ahead" if hs else "idle", {k: round(v, 2) for k, v in r.items()}, flush=True)
