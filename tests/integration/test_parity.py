"""Disaggregated training (a router, the encoder pool's and the LLM pool's ranks as processes,
tensors over UCX) reproduces single-process training: same losses, same updated parameters (fp32,
1e-5), for one rank per pool and for parallel layouts of both pools."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dyad import config as config_lib
from dyad.app.jobs import JobResult
from dyad.app.verify import compare_with_reference
from dyad.checkpoint import load_pool_state, saved_ranks
from dyad.data import make_dataset
from dyad.router.checkpoints import checkpoint_dir
from dyad.router.steps import StepPlanner
from dyad.service import build_model
from tests.helpers.resilience import run_in_process

TOLERANCE = 1e-5
STEPS = 6  # three of warm-up and three at the full rate, each compared
# The run's final held-out evaluation still runs in each layout, over 16 samples, not the whole
# split's 359: what it computes is checked against one device in tests/integration/test_evaluation.py.
EVALUATED = "eval.max_samples=16"

VARIABLE_IMAGES = ["data.multi_image_fraction=0.3", "data.text_only_fraction=0.2"]

LAYOUT_CASES = {
    # Samples with zero, one and several images; uneven microbatches; a shared expert.
    "mixed-images": [
        "train.global_batch=14", "train.microbatches=3", "data.multi_image_fraction=0.3",
        "data.text_only_fraction=0.2", "llm.moe.shared_expert_dim=32", "boundary.prefetch_depth=2",
    ],
    # One microbatch, no prefetch, a clipping norm that binds on every step.
    "clipped": ["train.global_batch=8", "train.microbatches=1", "boundary.prefetch_depth=1",
                "train.grad_clip=0.05"],
    # The boundary's layouts (each with 0, 1 and 2 images per sample): encoder dp1 -> LLM dp2
    # (with the optimizer replicated on every rank, where the other cases shard it);
    # dp3 -> dp2 (sizes that do not divide); dp2·tp2 -> tp2·cp2 (rows split by context shard,
    # tp ranks served by an in-pool broadcast, 2 x 2 patches merged per LLM token); dp4 -> cp2·dp2
    # with ep4. The last two update the aux-loss-free expert bias from counts that must be summed
    # over the whole pool: their ep group spans it in one, tp·cp in the other, so a reduction over
    # any smaller group breaks parity in one of them.
    "enc-dp1-llm-dp2": [*VARIABLE_IMAGES, "parallel.llm.dp=2", "train.global_batch=8", "train.shard_optimizer=false"],
    "enc-dp3-llm-dp2-ep2": [*VARIABLE_IMAGES, "parallel.encoder.dp=3", "parallel.llm.dp=2",
                            "parallel.llm.ep=2", "train.global_batch=12"],
    "enc-dp2-tp2-llm-tp2-cp2": [
        *VARIABLE_IMAGES, "parallel.encoder.dp=2", "parallel.encoder.tp=2", "parallel.llm.tp=2",
        "parallel.llm.cp=2", "train.global_batch=8", "encoder.spatial_merge=2", "llm.moe.expert_bias=true",
    ],
    "enc-dp4-llm-cp2-dp2-ep4": [*VARIABLE_IMAGES, "parallel.encoder.dp=4", "parallel.llm.cp=2",
                                "parallel.llm.dp=2", "parallel.llm.ep=4", "train.global_batch=8",
                                "llm.moe.expert_bias=true", "llm.moe.expert_bias_rate=0.05"],
    # Two pipeline stages of two data-parallel ranks each: the image rows go to the first stage's
    # ranks only, which return their gradients; the stages' expert biases move by their own
    # ranks' counts.
    "enc-dp3-llm-pp2-dp2": [*VARIABLE_IMAGES, "parallel.encoder.dp=3", "parallel.llm.pp=2", "parallel.llm.dp=2",
                            "llm.n_layers=4", "train.global_batch=12", "llm.moe.expert_bias=true",
                            "llm.moe.expert_bias_rate=0.05"],
    # The experts' w13 sliced over etp in (gate, up) pairs.
    "llm-dp4-ep2-etp2": [*VARIABLE_IMAGES, "parallel.llm.dp=4", "parallel.llm.ep=2", "parallel.llm.etp=2",
                         "train.global_batch=8"],
    # Both pools' blocks recomputing (train.recompute): the recomputed forward runs the
    # tensor-parallel, sequence-parallel and expert all-to-all collectives again in the backward
    # pass. The expert bias moves (at rates of 0.05 and 0.1 this layout's bias swings back and
    # forth and can end the steps at zero, here as in the reference); that its tokens are counted
    # once is checked in tests/integration/test_recompute.py (parity cannot see it: the update reads only
    # the counts' signs).
    "recompute-enc-tp2-llm-tp2-ep2-sp": [
        *VARIABLE_IMAGES, "parallel.encoder.tp=2", "parallel.llm.tp=2", "parallel.llm.ep=2",
        "parallel.sequence_parallel=true", "train.recompute=[encoder, llm]", "train.global_batch=8",
        "llm.moe.expert_bias=true", "llm.moe.expert_bias_rate=0.02",
    ],
}


def _config(tmp_path, overrides):
    config = config_lib.load(None, [f"train.steps={STEPS}", "train.warmup_steps=3", EVALUATED, *overrides])
    if config.llm.moe.expert_bias:
        # a checkpoint after every step shows the first update move the bias: at these rates it
        # swings back and forth and can end the steps at zero
        config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, interval_steps=1, keep_last=0))
    return dataclasses.replace(config, out_dir=str(tmp_path / "run"))


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_disaggregated_training_matches_single_process(tmp_path, case):
    config = _config(tmp_path, LAYOUT_CASES[case])
    job = run_in_process(config)
    assert job.succeeded, job.info.message
    assert len(job.metrics) == STEPS

    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    _assert_boundary_metrics_follow_the_plans(resolved, dataset, job)
    comparison = compare_with_reference(resolved, dataset, job)
    for step, loss, expected, error in comparison.losses:
        assert error <= TOLERANCE, f"step {step}: {loss} vs reference {expected}"
    assert comparison.worst_param_error <= TOLERANCE, comparison.worst_param

    # Training really happened: the parameters moved away from their initial values.
    initial = build_model(resolved, "encoder").state_dict()
    trained = load_pool_state(job.final_checkpoint(), "encoder")
    for pool in ("encoder", "llm"):  # every rank of each pool took part in the save
        ranks = getattr(config.parallel, pool).world_size
        assert saved_ranks(job.final_checkpoint(), pool) == list(range(ranks))
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)
    if case == "clipped":
        assert all(m["grad_norm"] > 0.05 for m in job.metrics)
    if resolved.llm.moe.expert_bias:  # the first update moved the bias (parity: to the reference's end)
        llm_state = load_pool_state(checkpoint_dir(job.info.out_dir, 1), "llm")
        biases = [value for name, value in llm_state.items() if name.endswith("expert_bias_E")]
        assert biases and all(bias.abs().sum() > 0 for bias in biases)


def _assert_boundary_metrics_follow_the_plans(config, dataset, job: JobResult) -> None:
    """Every step's boundary bytes, in the WatchRun stream and in metrics.jsonl, are what the
    router's plan for that step moves; the wait times are there and not negative."""
    lines = (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()
    written = [record for record in map(json.loads, lines) if "loss" in record]  # the steps' records
    assert [r["step"] for r in written] == [r["step"] for r in job.metrics] == list(range(STEPS))
    planner = StepPlanner(config, dataset)
    for streamed, record in zip(job.metrics, written):
        plan = planner.boundary_plan(planner.next(record["step"]))
        assert plan.bytes_forward > 0 and plan.bytes_backward > 0
        for metrics in (streamed, record):
            assert metrics["boundary_bytes_fwd"] == plan.bytes_forward, metrics
            assert metrics["boundary_bytes_bwd"] == plan.bytes_backward, metrics
            assert metrics["encoder_wait_s"] >= 0 and metrics["llm_wait_s"] >= 0, metrics
            assert 0 <= metrics["llm_fill_wait_s"] <= metrics["llm_wait_s"], metrics


def test_comparison_detects_a_different_loss(tmp_path):
    config = _config(tmp_path, ["train.steps=2", "train.global_batch=4"])
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2))
    job = run_in_process(config)
    assert job.succeeded, job.info.message
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    tampered = [dict(m, loss=m["loss"] * (1 + 1e-4)) for m in job.metrics]
    comparison = compare_with_reference(resolved, dataset, JobResult(job.info, tampered))
    assert not comparison.passed(TOLERANCE)
