"""Where dyad's MoE layer step spends host time (Mixtral-like shape), against torchtitan.
Diagnostic only (git-excluded)."""
import json, os, statistics, sys, time
sys.path.insert(0, "bench")
import torch
import moe_layer as ml
from dyad.kernels.moe_permute import permute, unpermute
from dyad.llm_service.moe import assignment_counts

OUT = os.environ.get("OUT", "/tmp")
shape = ml.SHAPES["mixtral-like"]
dim, hidden, E, K, T = shape
res = {}

def busy(n=30):
    a = ml._busy_operand()
    for _ in range(n):
        torch.mm(a, a)

def host_us(fn, reps=10):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(); busy()
        t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)

names = [n for n in sys.argv[1].split(",")]
steps = {}
for n in names:
    try:
        steps[n] = ml.layer_step(ml.LAYERS[n], shape, "cuda", torch.bfloat16)
    except Exception as e:
        print(n, "failed", e)
for n, s in steps.items():
    for _ in range(3): s()
    res[n] = {"host_step_us": host_us(s)}
    print(n, "host us per step (GPU busy):", round(res[n]["host_step_us"]))

# dyad breakdown: forward pieces and backward, host time with the GPU busy
for n in [n for n in names if n.startswith("dyad")]:
    layer = ml.dyad_layer(dim, hidden, E, K, gate_up="interleaved" if "interleaved" in n else "separate").cuda().to(torch.bfloat16)
    x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    pieces = {k: [] for k in ("route", "permute", "experts", "unpermute", "counts_aux", "backward")}
    for i in range(13):
        torch.cuda.synchronize(); busy()
        t0 = time.perf_counter()
        scores, gates, idx = layer.route(x)
        t1 = time.perf_counter()
        xs, order, counts = permute(x, idx, E)
        t2 = time.perf_counter()
        ys = layer.experts(xs, counts)
        t3 = time.perf_counter()
        y = unpermute(ys, order, gates)
        t4 = time.perf_counter()
        c = assignment_counts(idx, None, E)
        aux = layer.aux_loss(x, scores, idx, None, None, c)
        t5 = time.perf_counter()
        torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])
        t6 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 3:
            for k, v in zip(pieces, (t1-t0, t2-t1, t3-t2, t4-t3, t5-t4, t6-t5)):
                pieces[k].append(v * 1e6)
    res[n]["pieces_us"] = {k: round(statistics.median(v), 1) for k, v in pieces.items()}
    print(n, res[n]["pieces_us"])

# idle vs host-ahead step time, interleaved
idle = ml.time_interleaved(steps, 20, "cuda")
ahead = ml.time_interleaved(steps, 20, "cuda", head_start=True)
for n in steps:
    res[n]["idle_ms"], res[n]["ahead_ms"] = idle[n], ahead[n]
    print(f"{n:30s} idle {idle[n]:7.2f} ms  ahead {ahead[n]:7.2f} ms  gap {idle[n]-ahead[n]:5.2f}")
if "timeline" in sys.argv:
    from kernel_timeline import write_timeline
    for n, s in steps.items():
        write_timeline(s, f"{OUT}/timeline_{n}.txt", steps=2)
json.dump(res, open(f"{OUT}/probe_{int(time.time())}.json", "w"), indent=1)
