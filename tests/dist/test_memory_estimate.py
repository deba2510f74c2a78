"""The plan's memory estimate (dyad/app/dry_run.py over dyad/router/estimate.py) against what a
pool's worker holds, built as a run builds it: each rank's optimizer state is what
`ShardedOptimizer.state_bytes()` reports, its weights the bytes of its parameters (bf16 working
weights, float32 values, the masters the sharded optimizer keeps in pieces), its gradients those
of one backward pass, under layouts whose groups differ in size."""

from __future__ import annotations

import torch

from dyad import config as config_lib
from dyad.app.dry_run import rank_memories
from dyad.data import make_dataset
from dyad.kernels.master_weights import master_of, released
from dyad.pools import pool_type
from dyad.router.steps import StepPlanner
from dyad.service import compute_context
from dyad.transport import LoopbackTransport
from dyad.working_weights import trained_parameters
from tests.helpers.distributed import run_each

QWEN_LIKE = ["llm.n_heads=4", "llm.n_kv_heads=2", "llm.head_dim=16", "llm.qk_norm=head", "llm.moe.num_experts=4",
             "llm.moe.shared_expert_dim=32", "llm.moe.shared_expert_gate=true"]
WORKING = ["train.dtype=bfloat16", "train.working_weights=true"]


def _estimate(config, pool: str, rank: int):
    dataset = make_dataset(config.data)
    planner = StepPlanner(config, dataset)
    spec = planner.next(0)
    ranks = rank_memories(config, dataset, planner.image_tokens, spec, planner.boundary_plan(spec))
    return next(r.memory for r in ranks if (r.pool, r.rank) == (pool, rank))


def _parameter_bytes(model) -> int:
    """Bytes of every parameter's values and of its master's, where it has one with values."""
    masters = [master_of(p) for p in model.parameters()]
    held = [*model.parameters(), *(m for m in masters if m is not None and not released(m))]
    return sum(t.numel() * t.element_size() for t in held)


def _backward(worker, pool: str) -> None:
    generator = torch.Generator().manual_seed(0)  # the same inputs on every rank
    with compute_context(worker.config):
        if pool == "llm":
            ids = torch.randint(worker.config.llm.vocab_size, (2, 12), generator=generator)
            logits, aux = worker.model(ids)
            loss = logits.float().sum() + aux
        else:
            loss = worker.model(torch.rand(2, 1, 16, 16, generator=generator)).float().sum()
    loss.backward()


def _matches(rank, world_size, pool, overrides, sharded_over):
    config = config_lib.load(None, overrides)
    config = config_lib.resolve(config, vocab_size=make_dataset(config.data).tokenizer.vocab_size)
    worker = pool_type(pool).service_class()(config, LoopbackTransport(), rank, "estimate")
    expected = _estimate(config, pool, rank)
    plan = worker.gradient_plan
    assert {name: worker.groups.size(name) for name, params in plan.reduce_over.items() if params} == sharded_over
    assert worker.shards.state_bytes() == expected.optimizer
    assert _parameter_bytes(worker.model) == expected.weights
    _backward(worker, pool)
    grads = [p.grad for p in trained_parameters(worker.model) if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert sum(g.nbytes for g in grads) == expected.gradients


def test_the_estimate_is_what_the_workers_hold():
    run_each([
        # dp 2: every group of two ranks, the masters of the bf16 working weights in pieces too
        (_matches, ("llm", ["parallel.llm.dp=2", *QWEN_LIKE, *WORKING], {"dp_cp": 2, "stage": 2, "edp": 2})),
        # tp 2, ep 2: the dense parts held whole (no replicas), the routers, shared experts and
        # per-head q/k norms over both ranks, each expert on one
        (_matches, ("llm", ["parallel.llm.tp=2", "parallel.llm.ep=2", *QWEN_LIKE, "train.dtype=bfloat16"],
                    {"dp_cp": 1, "stage": 2, "edp": 1})),
        (_matches, ("encoder", ["parallel.encoder.dp=2", *WORKING], {"dp": 2})),
    ], 2)
