"""Packed rows (several samples a row, each attending only to itself) under the LLM's sequence-
splitting layouts: each rank holds its columns of the rows' documents and sample positions, and
the loss and every parameter gradient are the single-device model's on the whole rows (gloo,
spawned ranks, float32, 1e-5 relative in the max norm). The single-device packed model is
checked against one sample a row in tests/unit/test_packing.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dyad.data.batch import Batch
from dyad.layout import LLMLayout
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.llm_service.sharding import shard_microbatch
from dyad.parallel.gradients import full_tensors
from dyad.sequence_shards import sequence_shard
from tests.helpers.distributed import llm_and_parallel_twin, run_distributed
from tests.helpers.parity import assert_close, assert_tensors_close

VOCAB, PAD = 50, 0
CFG = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, dense_layers=(0,),
           dense_ffn_dim=48, max_seq_len=32, moe=MoEConfig(num_experts=4, top_k=2, expert_dim=24, aux_loss_coef=0.1))
ROWS = ((5, 7), (9,))  # sample lengths in each row
LAYOUTS = {"cp2": (dict(cp=2), False), "tp2-cp2-sp-ep2": (dict(tp=2, cp=2, ep=2), True)}


def _inputs():
    """The packed batch, its documents (numbered across rows, -1 on padding) and sample positions."""
    generator = torch.Generator().manual_seed(1)
    S = max(sum(row) for row in ROWS)
    shape = (len(ROWS), S)
    ids, targets = torch.full(shape, PAD), torch.full(shape, -100)
    documents, positions = torch.full(shape, -1), torch.zeros(shape, dtype=torch.long)
    sample = 0
    for b, row in enumerate(ROWS):
        at = 0
        for n in row:
            ids[b, at : at + n] = torch.randint(1, VOCAB, (n,), generator=generator)
            targets[b, at : at + n - 1] = ids[b, at + 1 : at + n]
            documents[b, at : at + n], positions[b, at : at + n] = sample, torch.arange(n)
            at, sample = at + n, sample + 1
    lengths = (documents >= 0).sum(1)
    batch = Batch(input_ids=ids, targets=targets, image_positions=torch.zeros(0, dtype=torch.long), image_ids=(),
                  lengths=lengths, n_targets=int((targets != -100).sum()))
    return batch, documents, positions


def _body(rank, world_size, degrees, sequence_parallel):
    layout = LLMLayout(**degrees)
    groups, reference, reduction, model = llm_and_parallel_twin(LLMConfig(**CFG), degrees, sequence_parallel)
    batch, documents, positions = _inputs()
    valid = documents >= 0
    logits, ref_aux = reference(batch.input_ids, valid_BS=valid, documents_BS=documents, sample_positions_BS=positions)
    ref_lm = reference.loss_sum(logits, batch.targets)
    (ref_lm + ref_aux).backward()

    local = shard_microbatch(batch, pad_id=PAD, cp=layout.cp, cp_rank=groups.index("cp"), tp=layout.tp)
    padded = sequence_shard(valid.shape[1], cp=layout.cp, tp=layout.tp, cp_rank=0).padded_len
    documents_padded = torch.full((len(ROWS), padded), -1)
    positions_padded = torch.zeros((len(ROWS), padded), dtype=torch.long)
    documents_padded[:, : valid.shape[1]], positions_padded[:, : valid.shape[1]] = documents, positions
    columns = local.positions_Sl
    logits, aux = model(local.input_ids_BSl, position_ids_S=columns, valid_BS=local.valid_BSl,
                        documents_BS=documents_padded[:, columns], sample_positions_BS=positions_padded[:, columns])
    lm = model.loss_sum(logits, local.targets_BSl)
    (lm + aux).backward()
    reduction.finish()

    losses = torch.stack([lm.detach() * (groups.index("tp") == 0), aux.detach()])
    dist.all_reduce(losses)
    assert_close(float(losses[0]), float(ref_lm), "lm loss")
    assert_close(float(losses[1]), float(ref_aux), "aux loss")
    assert_tensors_close(full_tensors(model, grads=True), {n: p.grad for n, p in reference.named_parameters()}, "grad")


@pytest.mark.parametrize("name", LAYOUTS)
def test_packed_rows_under_a_layout_match_single_device(name):
    degrees, sequence_parallel = LAYOUTS[name]
    run_distributed(_body, LLMLayout(**degrees).world_size, degrees, sequence_parallel)
