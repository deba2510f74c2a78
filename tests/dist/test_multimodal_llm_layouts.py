"""Qwen3-VL's additions to the LLM under its parallel layouts: multimodal rotary positions (per
sample, each rank's columns of them) and DeepStack rows (each rank adding those of its own
columns) give the single-device model's loss, parameter gradients and the gradients of the image
and DeepStack rows (gloo, spawned ranks, float32, 1e-5 relative in the max norm).

The single-device model is transformers' on the same inputs (tests/unit/test_hf_qwen3_vl_moe_text.py);
here a random one of the same shape, its inputs images of three grid sizes over two samples, one
right-padded, positions from `rope_index`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dyad.data.batch import Batch
from dyad.layout import LLMLayout
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.llm_service.rope_index import rope_index
from dyad.llm_service.sharding import shard_microbatch
from dyad.parallel.gradients import full_tensors
from dyad.sequence_shards import sequence_shard
from tests.helpers.distributed import llm_and_parallel_twin, run_distributed
from tests.helpers.parity import assert_close, assert_tensors_close

VOCAB, IMAGE, PAD, MERGE, LEVELS = 64, 63, 0, 2, 2
CFG = dict(
    vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm="head",
    mrope_section=(3, 3, 2), rope_theta=1000.0, dense_layers=(1,), dense_ffn_dim=48,
    moe=MoEConfig(num_experts=4, top_k=2, expert_dim=24),
)
GRIDS = [(1, 4, 6), (1, 8, 4), (1, 6, 6)]  # 2x3, 4x2 and 3x3 tokens after the merge

LAYOUTS = {
    "tp2-ep2": (dict(tp=2, ep=2), False),
    "tp2-sp": (dict(tp=2), True),
    "cp2": (dict(cp=2), False),
    "tp2-cp2-sp-ep2": (dict(tp=2, cp=2, ep=2), True),
}


def _inputs():
    """The batch (sample 0: two images, sample 1: one, right-padded), its rotary positions, the
    image rows and the DeepStack levels' rows."""
    generator = torch.Generator().manual_seed(1)

    def text(n):
        return torch.randint(1, IMAGE, (n,), generator=generator).tolist()

    def image(t, h, w):
        return [IMAGE] * (t * h * w // MERGE**2)

    rows = [text(3) + image(*GRIDS[0]) + text(2) + image(*GRIDS[1]) + text(4), text(5) + image(*GRIDS[2]) + text(3)]
    S = max(len(r) for r in rows)
    input_ids = torch.full((2, S), PAD, dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    valid = torch.arange(S) < lengths.unsqueeze(1)
    targets = torch.full_like(input_ids, -100)
    targets[:, :-1] = input_ids[:, 1:].masked_fill(~valid[:, 1:] | (input_ids[:, 1:] == IMAGE), -100)
    image_positions = (input_ids == IMAGE).flatten().nonzero().flatten()
    batch = Batch(input_ids=input_ids, targets=targets, image_positions=image_positions, image_ids=(0, 1, 2),
                  lengths=lengths, n_targets=int((targets != -100).sum()))
    positions_3BS = rope_index((input_ids == IMAGE).int(), torch.tensor(GRIDS), valid.int(), spatial_merge_size=MERGE)
    N = len(image_positions)
    boundary = [torch.randn(N, CFG["dim"], generator=generator) for _ in range(1 + LEVELS)]
    return batch, positions_3BS, boundary


def _loss(model, input_ids, valid, targets, positions_S, rope_3BS, image_positions, boundary):
    logits, aux = model(input_ids, boundary[0], image_positions, position_ids_S=positions_S, valid_BS=valid,
                        rope_positions_3BS=rope_3BS, deepstack_embeds=boundary[1:])
    return model.loss_sum(logits, targets), aux


def _layout_body(rank, world_size, degrees, sequence_parallel):
    layout = LLMLayout(**degrees)
    groups, reference, reduction, model = llm_and_parallel_twin(LLMConfig(**CFG), degrees, sequence_parallel)
    batch, rope_3BS, boundary = _inputs()

    expected = [r.clone().requires_grad_(True) for r in boundary]
    valid = torch.arange(batch.input_ids.shape[1]) < batch.lengths.unsqueeze(1)
    ref_lm, ref_aux = _loss(reference, batch.input_ids, valid, batch.targets, None, rope_3BS, batch.image_positions,
                            expected)
    (ref_lm + ref_aux).backward()

    local = shard_microbatch(batch, pad_id=PAD, cp=layout.cp, cp_rank=groups.index("cp"), tp=layout.tp)
    padded_3BS = torch.zeros(3, 2, sequence_shard(valid.shape[1], cp=layout.cp, tp=layout.tp, cp_rank=0).padded_len,
                             dtype=torch.long)
    padded_3BS[..., : valid.shape[1]] = rope_3BS  # padding at position 0, as rope_index puts it
    mine = [r[local.image_rows_Nl].clone().requires_grad_(True) for r in boundary]
    lm, aux = _loss(model, local.input_ids_BSl, local.valid_BSl, local.targets_BSl, local.positions_Sl,
                    padded_3BS[..., local.positions_Sl], local.image_positions_Nl, mine)
    (lm + aux).backward()
    reduction.finish()

    # the caption loss: each cp shard's part, every tp rank's the same; the aux loss: each rank's part
    losses = torch.stack([lm.detach() * (groups.index("tp") == 0), aux.detach()])
    dist.all_reduce(losses)
    assert_close(float(losses[0]), float(ref_lm), "lm loss")
    assert_close(float(losses[1]), float(ref_aux), "aux loss")
    for i, (got, want) in enumerate(zip(mine, expected)):  # cp shards add up, tp replicas agree
        grad = torch.zeros_like(want).index_copy(0, local.image_rows_Nl, got.grad)
        dist.all_reduce(grad, group=groups.group("cp"))
        assert_tensors_close({"rows": grad}, {"rows": want.grad}, "image rows" if i == 0 else f"deepstack {i - 1}")
    assert_tensors_close(full_tensors(model, grads=True), {n: p.grad for n, p in reference.named_parameters()}, "grad")


@pytest.mark.parametrize("name", LAYOUTS)
def test_multimodal_rotary_and_deepstack_under_a_layout_match_single_device(name):
    degrees, sequence_parallel = LAYOUTS[name]
    run_distributed(_layout_body, LLMLayout(**degrees).world_size, degrees, sequence_parallel)
