"""What the tests of compiled and recomputing models share: the digits job's config with a shared
expert, LLM inputs for it, and a short run checked against the single process."""

from __future__ import annotations

import dataclasses

import torch

from dyad import config as config_lib
from dyad.app.verify import compare_with_reference
from dyad.data import make_dataset
from tests.helpers.resilience import run_in_process


def resolved_config(overrides=()):
    config = config_lib.load(None, ["llm.moe.shared_expert_dim=32", *overrides])
    return config_lib.resolve(config, vocab_size=make_dataset(config.data).tokenizer.vocab_size)


def llm_inputs(config, device):
    """(token ids of two 24-token sequences, six image rows, their positions)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(config.llm.vocab_size, (2, 24), generator=generator).to(device)
    rows = torch.randn(6, config.llm.dim, generator=generator).to(device)
    positions = torch.tensor([1, 2, 3, 30, 31, 32], device=device)
    return ids, rows, positions


def assert_short_run_matches_single_process(overrides, tmp_path):
    """Three steps of the job under `overrides` against the eager single-process reference
    (which neither compiles nor recomputes): losses and parameters within 1e-5. The final held-out
    evaluation runs over two batches, not the whole split (tests/integration/test_evaluation.py
    checks what it computes)."""
    overrides = ["train.steps=3", "train.warmup_steps=1", "train.global_batch=8", "eval.max_samples=16", *overrides]
    config = dataclasses.replace(config_lib.load(None, overrides), out_dir=str(tmp_path / "run"))
    job = run_in_process(config)
    assert job.succeeded, job.info.message
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    comparison = compare_with_reference(resolved, dataset, job)
    assert all(error <= 1e-5 for *_, error in comparison.losses), comparison.losses
    assert comparison.worst_param_error <= 1e-5, comparison.worst_param
