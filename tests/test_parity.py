"""Disaggregated training (router + encoder pool + LLM pool as processes, tensors over UCX)
reproduces single-process training: same losses, same updated parameters (fp32, 1e-5), for one
rank per pool and for parallel layouts of both pools."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dyad import config as config_lib
from dyad.checkpoint import load_pool_state, saved_ranks
from dyad.data import make_dataset
from dyad.jobs import JobResult, run_job
from dyad.service import build_model
from dyad.verify import compare_with_reference

TOLERANCE = 1e-5

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
    # The boundary's layouts (each with 0, 1 and 2 images per sample): encoder dp1 -> LLM dp2;
    # dp3 -> dp2 (sizes that do not divide); dp2·tp2 -> tp2·cp2 (rows split by context shard,
    # tp ranks served by an in-pool broadcast, 2 x 2 patches merged per LLM token); dp4 -> cp2·dp2
    # with ep4.
    "enc-dp1-llm-dp2": [*VARIABLE_IMAGES, "parallel.llm.dp=2", "train.global_batch=8"],
    "enc-dp3-llm-dp2-ep2": [*VARIABLE_IMAGES, "parallel.encoder.dp=3", "parallel.llm.dp=2",
                            "parallel.llm.ep=2", "train.global_batch=12"],
    "enc-dp2-tp2-llm-tp2-cp2-broadcast": [
        *VARIABLE_IMAGES, "parallel.encoder.dp=2", "parallel.encoder.tp=2", "parallel.llm.tp=2",
        "parallel.llm.cp=2", "boundary.tp_delivery=broadcast", "train.global_batch=8", "encoder.spatial_merge=2",
    ],
    "enc-dp4-llm-cp2-dp2-ep4": [*VARIABLE_IMAGES, "parallel.encoder.dp=4", "parallel.llm.cp=2",
                                "parallel.llm.dp=2", "parallel.llm.ep=4", "train.global_batch=8"],
}


def _config(tmp_path, overrides):
    config = config_lib.load(None, ["train.steps=10", "train.warmup_steps=3", *overrides])
    return dataclasses.replace(config, out_dir=str(tmp_path / "run"))


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_disaggregated_training_matches_single_process(tmp_path, case):
    config = _config(tmp_path, LAYOUT_CASES[case])
    job = run_job(config, progress=False)
    assert job.succeeded, job.info.message
    assert len(job.metrics) == 10
    assert all(m["boundary_bytes_fwd"] > 0 and m["boundary_bytes_bwd"] > 0 for m in job.metrics)

    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
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


def test_comparison_detects_a_different_loss(tmp_path):
    config = _config(tmp_path, ["train.steps=2", "train.global_batch=4"])
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2))
    job = run_job(config, progress=False)
    assert job.succeeded, job.info.message
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    tampered = [dict(m, loss=m["loss"] * (1 + 1e-4)) for m in job.metrics]
    comparison = compare_with_reference(resolved, dataset, JobResult(job.info, tampered))
    assert not comparison.passed(TOLERANCE)
