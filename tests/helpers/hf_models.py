"""What the tests against transformers do to its tiny random models before saving them, and how
they read its gradients under dyad's names."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def make_norms_and_biases_matter(model: nn.Module, bias_std: float) -> nn.Module:
    """Norm weights drawn from [0.5, 1.5] and biases from N(0, bias_std²): transformers starts them
    at one and zero, where a mapping that drops or swaps them would go unseen."""
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.uniform_(0.5, 1.5)
        elif name.endswith("bias"):
            p.normal_(std=bias_std)
    return model


def gradients_under_dyad_names(reference: nn.Module, ours: nn.Module, path, encoder_state_dict) -> dict:
    """A whole transformers model's gradients (after its backward) saved in place of its weights,
    a checkpoint of its own names, read under the names of dyad's whole model `ours`: its
    `.encoder`'s by `encoder_state_dict`, its `.llm`'s. The reference's weights are lost."""
    from dyad.hf_checkpoint import HFCheckpoint
    from dyad.llm_service.hf import llm_state_dict

    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    reference.save_pretrained(path)
    checkpoint = HFCheckpoint(path)
    state = {f"encoder.{k}": v for k, v in encoder_state_dict(checkpoint, ours.encoder.cfg).items()}
    return state | {f"llm.{k}": v for k, v in llm_state_dict(checkpoint, ours.llm.cfg).items()}


def digits_tokenizer_in(path):
    """`path` made, holding tokenizer.json of the word tokenizer over the bundled digits' captions
    (the ids a tiny checkpoint's embedding shares with the default dataset); the tokenizer."""
    from dyad import config as config_lib
    from dyad.data import make_dataset
    from dyad.data.tokenizer import build_word_tokenizer

    dataset = make_dataset(config_lib.load(None, []).data)
    tokenizer = build_word_tokenizer(dataset.sample(i).text for i in range(len(dataset.train_ids)))
    path.mkdir()
    tokenizer.save(path / "tokenizer.json")
    return tokenizer
