"""Does float8 training (llm.fp8) learn like bf16? A small MoE LLM trains for 200 steps on a
synthetic language (an order-1 Markov chain, four successors per token with fixed random
probabilities, so the loss has a known floor: the chain's entropy), in bf16 and in float8, for
several seeds each. Every run sees the same batches; seeds change the initial weights.

"Within bf16 noise": |mean float8 - mean bf16| of the loss over the last 50 steps is no larger
than the spread (max - min) of that loss over the bf16 runs. Each seed runs `repeats` times:
bf16 training on a GPU is not bitwise repeatable (atomic adds in backward kernels), and identical
bf16 runs differ by as much as different seeds do, so the spread counts both.

    python bench/fp8_convergence.py --out $OUT/fp8_convergence.json     # on a GPU host
    python bench/fp8_convergence.py --toy                               # CPU, tiny (CI)
    python bench/fp8_convergence.py --from result.json --plot curves.png  # redraw a result
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
from run_info import bench_device, run_header, write_json  # beside this script

from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.llm_service.fp8 import convert_to_fp8
from dyad.llm_service.model import MoELM
from dyad.optim import build_optimizer

SETUPS = {
    "gpu": dict(
        llm=LLMConfig(
            vocab_size=4096,
            dim=1024,
            n_layers=8,
            n_heads=16,
            n_kv_heads=4,
            dense_ffn_dim=2816,
            dense_layers=(0,),
            max_seq_len=1024,
            moe=MoEConfig(num_experts=16, top_k=4, expert_dim=512, aux_loss_coef=0.01),
        ),
        batch=8,
        seq=1024,
        steps=200,
        seeds=3,
        repeats=2,
        lr=1e-3,
    ),
    "toy": dict(
        llm=LLMConfig(
            vocab_size=64,
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            dense_ffn_dim=128,
            dense_layers=(0,),
            max_seq_len=64,
            moe=MoEConfig(num_experts=4, top_k=2, expert_dim=32),
        ),
        batch=4,
        seq=32,
        steps=6,
        seeds=2,
        repeats=1,
        lr=1e-3,
    ),
}
SUCCESSORS = 4
TAIL = 50  # steps averaged at the end


def markov_chain(vocab: int, generator: torch.Generator):
    """Each token's successors and their probabilities; returns (successors_VK, probs_VK, entropy)."""
    successors = torch.stack([torch.randperm(vocab, generator=generator)[:SUCCESSORS] for _ in range(vocab)])
    weights = -torch.log(torch.rand(vocab, SUCCESSORS, generator=generator))  # Dirichlet(1, ..., 1)
    probs = weights / weights.sum(dim=1, keepdim=True)
    entropy = -(probs * probs.log()).sum(dim=1).mean().item()
    return successors, probs, entropy


def sample_batches(successors, probs, steps, batch, seq, generator) -> torch.Tensor:
    """[steps, batch, seq + 1] token ids walked along the chain."""
    walks = torch.empty(steps * batch, seq + 1, dtype=torch.long)
    walks[:, 0] = torch.randint(successors.shape[0], (steps * batch,), generator=generator)
    for t in range(seq):
        choice = torch.multinomial(probs[walks[:, t]], 1, generator=generator).squeeze(1)
        walks[:, t + 1] = successors[walks[:, t], choice]
    return walks.view(steps, batch, seq + 1)


def train(cfg: LLMConfig, batches: torch.Tensor, seed: int, fp8: bool, lr: float, device: str) -> list[float]:
    torch.manual_seed(seed)
    model = MoELM(cfg)
    if fp8:
        convert_to_fp8(model)
    model = model.to(device)
    optimizer = build_optimizer(model, argparse.Namespace(weight_decay=0.01, beta1=0.9, beta2=0.95, eps=1e-8, lr=lr))
    no_images = torch.zeros(0, cfg.dim, device=device)
    no_positions = torch.zeros(0, dtype=torch.long, device=device)
    losses = []
    for walk in batches.to(device):
        with torch.autocast(device, dtype=torch.bfloat16):
            logits, aux = model(walk[:, :-1], no_images, no_positions)
            loss = model.loss_sum(logits, walk[:, 1:]) / walk[:, 1:].numel()
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def plot(result: dict, path: str, smooth: int = 10) -> None:
    """Loss curves (moving average over `smooth` steps), bf16 against float8, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (whole, tail) = plt.subplots(1, 2, figsize=(11, 4))
    steps_run = len(result["losses"]["bf16"][0])
    first_tail = max(0, steps_run - 2 * result["tail_steps"])
    tail_values = []
    for precision, color in (("bf16", "tab:blue"), ("fp8", "tab:orange")):
        for run, losses in enumerate(result["losses"][precision]):
            curve = torch.tensor(losses).unfold(0, min(smooth, steps_run), 1).mean(dim=1)
            steps = list(range(steps_run - len(curve), steps_run))
            label = precision if run == 0 else None
            whole.plot(steps, curve, color=color, alpha=0.7, label=label)
            tail.plot(steps, curve, color=color, alpha=0.7, label=label)
            tail_values += [v for step, v in zip(steps, curve.tolist()) if step >= first_tail]
    whole.axhline(result["entropy_floor"], color="gray", linestyle=":", label="chain entropy")
    margin = (max(tail_values) - min(tail_values)) * 0.1 + 1e-6
    tail.set_xlim(first_tail, steps_run)
    tail.set_ylim(min(tail_values) - margin, max(tail_values) + margin)
    for ax, title in ((whole, "loss, all steps"), (tail, "last steps")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend()
    spread = result.get("bf16_spread", result.get("bf16_seed_spread"))  # results before repeats
    fig.suptitle(f"{result['device']}: fp8 - bf16 = {result['fp8_minus_bf16']:+.4f}, spread of the bf16 runs "
                 f"{spread:.4f} (mean of the last {result['tail_steps']} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--plot", help="draw the loss curves into this PNG")
    parser.add_argument("--from", dest="source", help="redraw this result JSON instead of training")
    args = parser.parse_args()
    if args.source:
        with open(args.source) as f:
            plot(json.load(f), args.plot or "fp8_convergence.png")
        return
    device = bench_device(args.toy)
    setup = SETUPS["toy" if device == "cpu" else "gpu"]
    cfg = setup["llm"]
    generator = torch.Generator().manual_seed(1234)
    successors, probs, entropy = markov_chain(cfg.vocab_size, generator)
    batches = sample_batches(successors, probs, setup["steps"], setup["batch"], setup["seq"], generator)
    runs = {"bf16": [], "fp8": []}
    for repeat in range(setup["repeats"]):
        for seed in range(setup["seeds"]):
            for precision in runs:
                losses = train(cfg, batches, seed, precision == "fp8", setup["lr"], device)
                runs[precision].append(losses)
                print(
                    f"seed {seed} run {repeat} {precision}: first {losses[0]:.3f}, last-{TAIL} mean "
                    f"{statistics.mean(losses[-TAIL:]):.4f}"
                )
    tail = {p: [statistics.mean(losses[-TAIL:]) for losses in runs[p]] for p in runs}
    gap = statistics.mean(tail["fp8"]) - statistics.mean(tail["bf16"])
    spread = max(tail["bf16"]) - min(tail["bf16"])
    within = abs(gap) <= spread
    seeds = setup["seeds"]
    rerun_spread = max(
        (max(tail["bf16"][s::seeds]) - min(tail["bf16"][s::seeds]) for s in range(seeds)), default=0.0
    )
    print(f"chain entropy (loss floor) {entropy:.3f}, start ~ln(V) = {math.log(cfg.vocab_size):.3f}")
    print(
        f"fp8 - bf16 over the last {TAIL} steps: {gap:+.4f}; spread of the bf16 runs {spread:.4f} "
        f"(the same seed run again: up to {rerun_spread:.4f}): {'within' if within else 'NOT within'} bf16 noise"
    )
    result = {
        **run_header(device),
        "steps": setup["steps"],
        "seeds": setup["seeds"],
        "repeats": setup["repeats"],
        "tokens_per_step": setup["batch"] * setup["seq"],
        "entropy_floor": entropy,
        "tail_steps": TAIL,
        "tail_mean": tail,
        "fp8_minus_bf16": gap,
        "bf16_spread": spread,
        "bf16_same_seed_spread": rerun_spread,
        "within_bf16_noise": within,
        "losses": runs,
    }
    write_json(args.out, result, indent=None)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
