"""Are the MoE step's prologue launches exposed on this host? Idle step time with n tiny kernels
launched first (diagnostic, git-excluded)."""
import statistics, sys, time
sys.path.insert(0, "bench")
import torch
import moe_layer as ml
dim, hidden, E, K, T = ml.SHAPES["mixtral-like"]
a = torch.randn(1024, device="cuda")
def host_one(fn, n=50):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)
print("one add, host us:", round(host_one(lambda: a.add_(1.0)), 1))
print("10 adds, host us:", round(host_one(lambda: [a.add_(1.0) for _ in range(10)]), 1))
from dyad.kernels.moe_router import router_logits, softmax_topk
x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16); w = torch.randn(E, dim, device="cuda", dtype=torch.bfloat16)
lg = router_logits(x, w)
print("router_logits host us:", round(host_one(lambda: router_logits(x, w)), 1))
print("softmax_topk host us:", round(host_one(lambda: softmax_topk(lg, K)), 1))
ids = torch.randint(0, E, (T * K,), device="cuda")
from dyad.kernels.moe_permute import stable_expert_order, expert_counts
print("stable_expert_order host us:", round(host_one(lambda: stable_expert_order(ids, E)), 1))
print("expert_counts host us:", round(host_one(lambda: expert_counts(ids, E)), 1))
print("cumsum int32 host us:", round(host_one(lambda: torch.cumsum(ids[:8], 0, dtype=torch.int32)), 1))
steps = {}
for gate_up in sys.argv[1].split(","):
    base = ml.layer_step(lambda *s, g=gate_up: ml.dyad_layer(*s, gate_up=g), ml.SHAPES["mixtral-like"], "cuda", torch.bfloat16)
    for n in (0, 12, 24):
        steps[f"{gate_up}+{n}"] = (lambda b=base, n=n: ([a.add_(1.0) for _ in range(n)], b()))
idle = ml.time_interleaved(steps, 20, "cuda"); ahead = ml.time_interleaved(steps, 20, "cuda", head_start=True)
for n in steps: print(f"{n:16s} idle {idle[n]:7.2f} ahead {ahead[n]:7.2f}")
