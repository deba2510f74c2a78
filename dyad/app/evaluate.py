"""A trained model on the held-out split, on one device: its loss (cross-entropy per caption
token), and caption accuracy: given the image(s) and the caption's prompt, does greedy decoding
produce the answer (e.g. the digit word) exactly? `dyad eval` and `dyad train`'s last record.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dyad.checkpoint import load_pool_state
from dyad.config import RunConfig
from dyad.data import build_prompt
from dyad.data.batch import collate
from dyad.encoder_service.hf_config import image_processor, image_tokens
from dyad.encoder_service.step import encode_rows
from dyad.llm_service.model import greedy_next_token
from dyad.llm_service.rope_index import IMAGE, TEXT, rope_index
from dyad.llm_service.step import microbatch_loss, whole_microbatch
from dyad.router.checkpoints import MANIFEST
from dyad.service import build_model, compute_context

_EVAL_BATCH = 128


@torch.no_grad()
def caption_accuracy(config: RunConfig, dataset, encoder, llm) -> tuple[float, int]:
    """(fraction of held-out samples whose answer is decoded exactly, samples evaluated)."""
    encoder.eval()
    llm.eval()
    samples = [dataset.sample(i) for i in dataset.heldout_ids]
    samples = [s for s in samples if s.answer is not None]
    if not samples:
        return float("nan"), 0
    correct = 0
    for start in range(0, len(samples), _EVAL_BATCH):
        chunk = samples[start : start + _EVAL_BATCH]
        correct += int(_decode_matches(config, dataset, encoder, llm, chunk).sum())
    return correct / len(samples), len(samples)


@torch.no_grad()
def heldout_loss(config: RunConfig, dataset, encoder, llm) -> tuple[float, int]:
    """(the LM loss per caption token over the held-out samples, caption tokens counted)."""
    encoder.eval()
    llm.eval()
    device = config.train.device
    tokens = image_tokens(config.encoder, dataset)
    batches = [
        collate(dataset.tokenizer, [dataset.sample(i) for i in dataset.heldout_ids[start : start + _EVAL_BATCH]], tokens)
        for start in range(0, len(dataset.heldout_ids), _EVAL_BATCH)
    ]
    targets = sum(batch.n_targets for batch in batches)
    if targets == 0:
        return float("nan"), 0
    total = 0.0
    processor = image_processor(config.encoder)  # read once, not per batch
    for batch in batches:
        batch = batch.to(device)
        local = whole_microbatch(batch, dataset.tokenizer.pad_id, multimodal_rope=config.llm.multimodal_rope)
        with compute_context(config):
            rows_RD = None
            if batch.image_ids:
                rows_RD = encode_rows(encoder, dataset, batch.image_ids, device, processor,
                                      deepstack=config.llm.reads_deepstack)[local.image_rows_Nl]
            loss = microbatch_loss(llm, local, rows_RD, global_target_tokens=targets, global_microbatches=len(batches))
        total += float(loss.lm)
    return total, targets


def _decode_matches(config, dataset, encoder, llm, samples) -> torch.Tensor:
    device = config.train.device
    tokens = image_tokens(config.encoder, dataset)
    prompts = [build_prompt(dataset.tokenizer, s, tokens) for s in samples]
    answer_len = max(len(answer) for _, _, answer in prompts)
    S = max(len(ids) for ids, _, _ in prompts) + answer_len
    input_ids_BS = torch.full((len(samples), S), dataset.tokenizer.pad_id, dtype=torch.long)
    answers_BA = torch.full((len(samples), answer_len), -1, dtype=torch.long)
    positions = []
    for b, (ids, image_positions, answer) in enumerate(prompts):
        input_ids_BS[b, : len(ids)] = torch.tensor(ids)
        answers_BA[b, : len(answer)] = torch.tensor(answer)
        positions.extend(b * S + p for p in image_positions)
    lengths_B = torch.tensor([len(ids) for ids, _, _ in prompts])
    image_ids = [i for s in samples for i in s.image_ids]
    rows_RD, deepstack = None, None
    if image_ids:
        rows_RD = encode_rows(encoder, dataset, image_ids, device, image_processor(config.encoder),
                              deepstack=config.llm.reads_deepstack)
        rows_RD, *deepstack = rows_RD.split(config.llm.dim, dim=1)
    rope_3BS = None
    if config.llm.mrope_section:  # every column past a prompt is text, as the decoded tokens will be
        types_BS = torch.full(input_ids_BS.shape, TEXT, dtype=torch.long)
        types_BS.view(-1)[torch.tensor(positions, dtype=torch.long)] = IMAGE
        grids_I3 = torch.tensor([tokens.token_grid(i) for i in image_ids], dtype=torch.long).view(-1, 3)
        rope_3BS = rope_index(types_BS, grids_I3, spatial_merge_size=1).to(device)
    positions_N = torch.tensor(positions, dtype=torch.long, device=device)
    input_ids_BS, answers_BA, lengths_B = (t.to(device) for t in (input_ids_BS, answers_BA, lengths_B))

    matches_B = torch.ones(len(samples), dtype=torch.bool, device=device)
    rows_B = torch.arange(len(samples), device=device)
    for k in range(answer_len):
        predicted_B = greedy_next_token(llm, input_ids_BS, rows_RD, positions_N, lengths_B,
                                        rope_positions_3BS=rope_3BS, deepstack_embeds=deepstack)
        expected_B = answers_BA[:, k]
        active_B = expected_B >= 0
        matches_B &= ~active_B | (predicted_B == expected_B)
        input_ids_BS[rows_B, lengths_B] = predicted_B  # feed the model's own token back
        lengths_B = lengths_B + 1
    return matches_B


def load_trained(config: RunConfig, checkpoint_dir: Path):
    """The encoder and LLM of a committed checkpoint, as single-device models."""
    if not (checkpoint_dir / MANIFEST).exists():
        raise ValueError(f"{checkpoint_dir} has no {MANIFEST}: not a committed checkpoint")
    models = []
    for pool in ("encoder", "llm"):
        model = build_model(config, pool)
        model.load_state_dict(load_pool_state(checkpoint_dir, pool))
        models.append(model)
    return models
