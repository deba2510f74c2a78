"""The digits job's config with a shared expert, and LLM inputs for it: what the tests of whole
compiled or recomputing models share."""

from __future__ import annotations

import torch

from dyad import config as config_lib
from dyad.data import make_dataset


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
