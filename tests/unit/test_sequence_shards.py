"""dyad.sequence_shards: the padding, the zig-zag context shards and the tp split they allow, as
properties over random lengths and degrees; and the torch callers reading the same positions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dyad.data.batch import Batch
from dyad.llm_service.context_parallel import zigzag_positions
from dyad.llm_service.sharding import shard_microbatch
from dyad.sequence_shards import sequence_shard

geometries = st.tuples(st.integers(0, 300), st.integers(1, 5), st.integers(1, 4))  # seq_len, cp, tp


def shards(seq_len: int, cp: int, tp: int):
    return [sequence_shard(seq_len, cp=cp, tp=tp, cp_rank=r) for r in range(cp)]


def positions(shard) -> list[int]:
    return [p for span in shard.spans for p in span]


@settings(max_examples=500, deadline=None)
@given(geometries)
def test_padding_is_the_least_multiple_that_splits_every_shard_over_tp(geometry):
    seq_len, cp, tp = geometry
    multiple = 2 * cp * tp if cp > 1 else tp
    for shard in shards(seq_len, cp, tp):
        assert shard.padded_len % multiple == 0
        assert seq_len <= shard.padded_len < seq_len + multiple


@settings(max_examples=500, deadline=None)
@given(geometries)
def test_every_position_is_held_by_exactly_one_cp_rank_in_ascending_spans(geometry):
    seq_len, cp, tp = geometry
    held = [positions(shard) for shard in shards(seq_len, cp, tp)]
    padded_len = shards(seq_len, cp, tp)[0].padded_len
    assert sorted(p for rank in held for p in rank) == list(range(padded_len))
    for rank in held:
        assert rank == sorted(rank)
        assert len(rank) == padded_len // cp  # the same share for every rank


@settings(max_examples=500, deadline=None)
@given(geometries)
def test_cp_rank_holds_zigzag_chunks_i_and_2cp_minus_1_minus_i(geometry):
    seq_len, cp, tp = geometry
    for rank, shard in enumerate(shards(seq_len, cp, tp)):
        if cp == 1:
            assert shard.spans == (range(shard.padded_len),)
            continue
        chunk = shard.padded_len // (2 * cp)
        assert shard.spans == (
            range(rank * chunk, (rank + 1) * chunk),
            range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
        )


@settings(max_examples=500, deadline=None)
@given(geometries)
def test_causal_attention_work_is_the_same_on_every_cp_rank(geometry):
    seq_len, cp, tp = geometry
    work = {sum(p + 1 for p in positions(shard)) for shard in shards(seq_len, cp, tp)}  # keys per query
    assert len(work) == 1


@settings(max_examples=500, deadline=None)
@given(geometries)
def test_sequence_parallel_splits_each_shard_into_equal_contiguous_parts(geometry):
    """Sequence parallelism cuts the local columns with `chunk` along the sequence: tp equal parts,
    each a contiguous run of local columns, together the whole shard in order."""
    seq_len, cp, tp = geometry
    for shard in shards(seq_len, cp, tp):
        local = torch.tensor(positions(shard), dtype=torch.long)
        size = local.numel() // tp
        assert size * tp == local.numel()
        if size == 0:
            continue
        parts = local.chunk(tp)
        assert len(parts) == tp
        for t, part in enumerate(parts):
            assert part.tolist() == positions(shard)[t * size : (t + 1) * size]


@settings(max_examples=200, deadline=None)
@given(st.tuples(st.integers(1, 300), st.integers(1, 5), st.integers(1, 4)), st.integers(1, 3))
def test_the_torch_callers_hold_the_same_positions(geometry, batch):
    seq_len, cp, tp = geometry
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    microbatch = Batch(
        input_ids=ids,
        targets=ids,
        image_positions=torch.zeros(0, dtype=torch.long),
        image_ids=(),
        lengths=torch.full((batch,), seq_len),
        n_targets=0,
    )
    for rank, shard in enumerate(shards(seq_len, cp, tp)):
        local = shard_microbatch(microbatch, pad_id=0, cp=cp, cp_rank=rank, tp=tp)
        assert local.positions_Sl.tolist() == positions(shard)
        assert local.input_ids_BSl.shape == (batch, len(positions(shard)))
        if cp > 1:
            assert zigzag_positions(shard.padded_len, cp, rank).tolist() == positions(shard)
