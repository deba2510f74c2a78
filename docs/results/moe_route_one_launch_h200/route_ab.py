"""A/B of the router in one launch (diagnostic, git-excluded): kernel and host time of the route
alone, then the layer's forward host time and its step idle / host ahead, one launch against the
two kernels (logits, then softmax top-k), both shapes, interleaved layer (QuACK where installed)."""
import statistics, sys, time
sys.path.insert(0, "bench")
import torch
import moe_layer as ml
from dyad.kernels import gated_experts as ge
from dyad.kernels import moe_router as mr
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


def two_launches(x, w, k, bias=None, normalize=True):
    return mr.softmax_topk(mr.router_logits(x, w), k, bias, normalize)


class TwoLaunches(moe_mod.MoELayer):
    def forward(self, *a, **k):
        moe_mod.route_softmax_topk = two_launches
        try:
            return super().forward(*a, **k)
        finally:
            moe_mod.route_softmax_topk = mr.route_softmax_topk


for shape in sys.argv[1:] or ["mixtral-like", "qwen3-like"]:
    dim, hidden, E, K, T = ml.SHAPES[shape]
    x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(E, dim, device="cuda") * 0.02)
    with torch.no_grad():
        one, two = mr.route_softmax_topk(x, w, K), two_launches(x, w, K)
    print(shape, "route equal (scores, gates, idx):", [torch.equal(a, b) for a, b in zip(one, two)], flush=True)
    print(shape, f"route gpu us: one launch {gpu_us(lambda: mr.route_softmax_topk(x, w, K)):.1f}, "
          f"two {gpu_us(lambda: two_launches(x, w, K)):.1f}; host us: one {host_us(lambda: mr.route_softmax_topk(x, w, K)):.1f}, "
          f"two {host_us(lambda: two_launches(x, w, K)):.1f}", flush=True)

    layers = {
        "one_launch": ml.dyad_interleaved_layer(dim, hidden, E, K),
        "two_launches": ml.dyad_layer(dim, hidden, E, K, TwoLaunches, gate_up="interleaved"),
    }
    layers = {k: v.cuda().to(torch.bfloat16) for k, v in layers.items()}
    for lay in layers.values():
        torch.manual_seed(0)
        for p in lay.parameters():
            torch.nn.init.normal_(p, std=0.02)
    outs = {}
    for k, lay in layers.items():
        x.grad = None
        y, aux = lay(x)
        torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])
        outs[k] = (y.detach().clone(), x.grad.clone(), lay.w13_ED2F.grad.clone(), lay.router.weight.grad.clone())
    print(shape, "one == two (y, dx, dw13, drouter):",
          [torch.equal(a, b) for a, b in zip(outs["one_launch"], outs["two_launches"])],
          "max rel:", [((a.float() - b.float()).norm() / b.float().norm()).item()
                       for a, b in zip(outs["one_launch"], outs["two_launches"])], flush=True)
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
        print(f"{shape} {k}: forward host us (GPU busy) median {statistics.median(fwd):.0f}", flush=True)

    def step(lay):
        y, aux = lay(x)
        torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])

    steps = {k: (lambda lay=lay: step(lay)) for k, lay in layers.items()}
    for rnd in range(2):
        for hs in (False, True):
            r = ml.time_interleaved(steps, 20, "cuda", head_start=hs)
            print(f"{shape} round {rnd}", "host ahead" if hs else "idle", {k: round(v, 2) for k, v in r.items()}, flush=True)
    del layers, outs
    torch.cuda.empty_cache()
