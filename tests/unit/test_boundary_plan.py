"""The minimal boundary plan: exactly-once delivery and gradient return, minimal bytes, encoder
balance, for random layouts and microbatches; checked against the LLM's real `shard_microbatch`.

The simulation labels every image row by (microbatch, global image row), builds each encoder
group's source rows from the plan's encoder work, applies every transfer's segments into the
receivers' buffers (then tp rank 0's broadcast to its tp group) and compares each LLM rank's buffer with
the rows `shard_microbatch` says it holds.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dyad.data import DataConfig, FixedTokens, build_sequence, make_dataset
from dyad.data.batch import Batch, collate
from dyad.layout import EncoderLayout, LLMLayout
from dyad.llm_service.sharding import shard_microbatch
from dyad.router.boundary import (
    ImageSlot,
    PlannedMicrobatch,
    PlannedSample,
    Segment,
    leader_broadcast_traffic,
    minimum_bytes,
    plan_boundary,
)

HIDDEN, ELEMENT_SIZE = 8, 2


# ---- the oracle: the real LLM-side sharding -----------------------------------------------------


def image_first_rows(mb: PlannedMicrobatch) -> dict[int, int]:
    """image_id -> its first global image row (ids are unique within a microbatch in these tests)."""
    first, row = {}, 0
    for sample in mb.samples:
        for image in sample.images:
            first[image.image_id] = row
            row += image.tokens
    return first


def n_rows(mb: PlannedMicrobatch) -> int:
    return sum(image.tokens for sample in mb.samples for image in sample.images)


def expected_local_rows(mb: PlannedMicrobatch, llm: LLMLayout, rank: int) -> list[int]:
    """The global image rows `shard_microbatch` places on `rank`, in local-row order: none on a
    later pipeline stage, which never splices them."""
    coords = llm.coords(rank)
    if coords["dp"] != mb.llm_dp_rank or coords["pp"] > 0 or n_rows(mb) == 0:
        return []
    S = max(sample.seq_len for sample in mb.samples)
    positions = [
        b * S + image.position + t
        for b, sample in enumerate(mb.samples)
        for image in sample.images
        for t in range(image.tokens)
    ]
    batch = Batch(
        input_ids=torch.zeros(len(mb.samples), S, dtype=torch.long),
        targets=torch.zeros(len(mb.samples), S, dtype=torch.long),
        image_positions=torch.tensor(positions, dtype=torch.long),
        image_ids=(),
        lengths=torch.tensor([sample.seq_len for sample in mb.samples]),
        n_targets=0,
    )
    local = shard_microbatch(batch, pad_id=0, cp=llm.cp, cp_rank=coords["cp"], tp=llm.tp)
    return local.image_rows_Nl.tolist()


# ---- the simulation -----------------------------------------------------------------------------


def source_rows(plan, microbatches, encoder) -> dict[tuple[int, int], list[int]]:
    """(encoder source rank, microbatch) -> global image rows of that group's output, in order."""
    by_index = {mb.index: mb for mb in microbatches}
    sources = {}
    for work in plan.encoder_work:
        first = image_first_rows(by_index[work.microbatch])
        key = (encoder.rank(tp=0, dp=work.encoder_dp_rank), work.microbatch)
        assert key not in sources
        sources[key] = [first[im.image_id] + t for im in work.images for t in range(im.tokens)]
    return sources


def deliver(plan, microbatches, encoder, llm) -> dict[tuple[int, int], list[int]]:
    """(LLM rank, microbatch) -> its local image-row buffer after the step's forward delivery,
    asserting every local row is written exactly once."""
    sources = source_rows(plan, microbatches, encoder)
    buffers = {(e.llm_rank, e.microbatch): [None] * e.rows for e in plan.local_rows}
    assert len(buffers) == len(plan.local_rows)
    for transfer in plan.transfers:
        src = sources[(transfer.src_rank, transfer.microbatch)]
        dst = buffers[(transfer.dst_rank, transfer.microbatch)]
        for segment in transfer.segments:
            for k in range(segment.length):
                assert dst[segment.dst_row + k] is None, "a local row written twice"
                dst[segment.dst_row + k] = src[segment.src_row + k]
    for (rank, microbatch), buffer in buffers.items():
        coords = llm.coords(rank)
        if coords["tp"] > 0:
            assert buffer == [None] * len(buffer), "a tp > 0 rank received over the boundary"
            leader = llm.rank(tp=0, cp=coords["cp"], dp=coords["dp"], pp=coords["pp"])
            buffer[:] = buffers[(leader, microbatch)]
    for buffer in buffers.values():
        assert None not in buffer, "a local row never written"
    return buffers


# ---- random steps -------------------------------------------------------------------------------


@st.composite
def samples(draw, sample_id: int, next_image_id: list[int]) -> PlannedSample:
    position = draw(st.integers(1, 6))  # bos and some text before the first image
    images = []
    for _ in range(draw(st.integers(0, 3))):
        tokens = draw(st.integers(1, 20))
        images.append(ImageSlot(next_image_id[0], tokens, position))
        next_image_id[0] += 1
        position += tokens + draw(st.integers(0, 6))  # images may be adjacent
    seq_len = position + draw(st.integers(1, 12))  # eos and trailing text
    return PlannedSample(sample_id, seq_len, tuple(images))


@st.composite
def steps(draw):
    encoder = EncoderLayout(dp=draw(st.integers(1, 4)), tp=draw(st.integers(1, 2)))
    llm = LLMLayout(tp=draw(st.integers(1, 2)), cp=draw(st.integers(1, 3)), dp=draw(st.integers(1, 4)),
                    pp=draw(st.integers(1, 3)))
    next_image_id, next_sample_id, microbatches = [0], 0, []
    for index in range(draw(st.integers(0, 5))):
        mb_samples = []
        for _ in range(draw(st.integers(1, 4))):
            mb_samples.append(draw(samples(next_sample_id, next_image_id)))
            next_sample_id += 1
        dp_rank = draw(st.integers(0, llm.dp - 1))
        microbatches.append(PlannedMicrobatch(index, dp_rank, tuple(mb_samples)))
    return encoder, llm, microbatches


def plan_of(encoder, llm, microbatches):
    return plan_boundary(microbatches, encoder=encoder, llm=llm, hidden=HIDDEN, element_size=ELEMENT_SIZE)


# ---- properties ---------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(steps())
def test_forward_rows_arrive_exactly_once_where_shard_microbatch_wants_them(step):
    encoder, llm, microbatches = step
    plan = plan_of(encoder, llm, microbatches)
    buffers = deliver(plan, microbatches, encoder, llm)
    for mb in microbatches:
        for rank in range(llm.world_size):
            assert buffers.get((rank, mb.index), []) == expected_local_rows(mb, llm, rank)


@settings(max_examples=400, deadline=None)
@given(steps())
def test_every_gradient_row_returns_to_its_source_exactly_once(step):
    encoder, llm, microbatches = step
    plan = plan_of(encoder, llm, microbatches)
    sources = source_rows(plan, microbatches, encoder)
    by_index = {mb.index: mb for mb in microbatches}
    returned = Counter()
    for transfer in plan.transfers:  # each returns its rows' gradient
        assert llm.coords(transfer.dst_rank)["tp"] == 0, "only tp rank 0 of a shard receives and returns"
        assert llm.coords(transfer.dst_rank)["pp"] == 0, "only the first pipeline stage receives and returns"
        local = expected_local_rows(by_index[transfer.microbatch], llm, transfer.dst_rank)
        src = sources[(transfer.src_rank, transfer.microbatch)]
        for segment in transfer.segments:  # mirrored: local rows -> source rows
            for k in range(segment.length):
                row = local[segment.dst_row + k]
                assert src[segment.src_row + k] == row
                returned[(transfer.microbatch, row)] += 1
    assert returned == Counter({(mb.index, r): 1 for mb in microbatches for r in range(n_rows(mb))})


@settings(max_examples=400, deadline=None)
@given(steps())
def test_bytes_are_the_minimum(step):
    encoder, llm, microbatches = step
    plan = plan_of(encoder, llm, microbatches)
    forward, backward = minimum_bytes(microbatches, hidden=HIDDEN, element_size=ELEMENT_SIZE)
    assert (plan.bytes_forward, plan.bytes_backward) == (forward, backward)
    rows = sum(n_rows(mb) for mb in microbatches)
    assert forward == backward == rows * HIDDEN * ELEMENT_SIZE, "each row crosses once each way"
    traffic = plan.traffic()
    assert traffic.forward + traffic.intra_forward == rows * llm.tp * HIDDEN * ELEMENT_SIZE
    assert traffic.intra_forward == forward * (llm.tp - 1)
    leader = leader_broadcast_traffic(microbatches, llm=llm, hidden=HIDDEN, element_size=ELEMENT_SIZE)
    assert leader.forward + leader.intra_forward == rows * llm.tp * llm.cp * HIDDEN * ELEMENT_SIZE
    assert traffic.total <= leader.total


@settings(max_examples=400, deadline=None)
@given(steps())
def test_encoder_work_covers_each_image_once_and_is_balanced(step):
    encoder, llm, microbatches = step
    plan = plan_of(encoder, llm, microbatches)
    patches = [0] * encoder.dp
    for mb in microbatches:
        order = [im.image_id for sample in mb.samples for im in sample.images]
        works = [w for w in plan.encoder_work if w.microbatch == mb.index]
        assert len({w.encoder_dp_rank for w in works}) == len(works)
        encoded = [im.image_id for w in works for im in w.images]
        assert sorted(encoded) == sorted(order)
        for work in works:
            assert work.images, "empty work is not listed"
            ids = [im.image_id for im in work.images]
            assert ids == sorted(ids, key=order.index), "a group's images in global order"
            patches[work.encoder_dp_rank] += work.rows
    assert list(plan.encoder_patches) == patches
    # List scheduling: max <= mean + (1 - 1/G) * largest image, i.e. G*max <= T + (G-1)*t_max.
    G, total = encoder.dp, sum(patches)
    largest = max((im.tokens for mb in microbatches for s in mb.samples for im in s.images), default=0)
    assert G * max(patches) <= total + (G - 1) * largest
    assert plan.encoder_imbalance == (1.0 if total == 0 else max(patches) * G / total)


@settings(max_examples=400, deadline=None)
@given(steps())
def test_plan_lists_only_what_exists(step):
    encoder, llm, microbatches = step
    plan = plan_of(encoder, llm, microbatches)
    keys = [(t.src_rank, t.dst_rank, t.microbatch) for t in plan.transfers]
    assert len(set(keys)) == len(keys), "one message per (source, destination, microbatch)"
    for transfer in plan.transfers:
        assert transfer.rows > 0
        for a, b in zip(transfer.segments, transfer.segments[1:]):
            assert a.src_row + a.length <= b.src_row and a.dst_row + a.length <= b.dst_row
            assert (a.src_row + a.length, a.dst_row + a.length) != (b.src_row, b.dst_row), "not maximal"
    receivers = {(t.dst_rank, t.microbatch) for t in plan.transfers}
    for mb in microbatches:
        for rank in range(llm.world_size):
            if not expected_local_rows(mb, llm, rank):  # nothing lands here: no transfer, no buffer
                assert (rank, mb.index) not in receivers
                assert all((e.llm_rank, e.microbatch) != (rank, mb.index) for e in plan.local_rows)
        if n_rows(mb) == 0:
            assert not [w for w in plan.encoder_work if w.microbatch == mb.index]
    json.dumps(dataclasses.asdict(plan))  # plain data all the way down


# ---- hand-checked examples ----------------------------------------------------------------------


def one_sample(seq_len, *images, index=0, dp_rank=0):
    slots = tuple(ImageSlot(image_id, tokens, position) for image_id, tokens, position in images)
    return PlannedMicrobatch(index, dp_rank, (PlannedSample(index, seq_len, slots),))


def test_cp2_zigzag_splits_one_long_image_across_shards():
    # seq_len 20, cp=2, tp=1: padded to 20, chunks of 5; cp 0 holds 0-4 and 15-19, cp 1 holds 5-14.
    # The image fills positions 1-16 (rows 0-15): cp 0 gets rows 0-3 and 14-15, cp 1 rows 4-13.
    mb = one_sample(20, (7, 16, 1))
    plan = plan_boundary([mb], encoder=EncoderLayout(), llm=LLMLayout(cp=2), hidden=1, element_size=1)
    assert [(t.dst_rank, t.segments) for t in plan.transfers] == [
        (0, (Segment(0, 0, 4), Segment(14, 4, 2))),
        (1, (Segment(4, 0, 10),)),
    ]
    assert [(e.llm_rank, e.rows) for e in plan.local_rows] == [(0, 6), (1, 10)]


def test_cp2_tp2_padding_and_broadcast_delivery():
    # cp=2, tp=2: padded to a multiple of 8 -> 24, chunks of 6; cp 0 holds 0-5, 18-23.
    # Ranks: (tp, cp) -> tp + 2*cp. Image at 1-16: cp 0 rows 0-4, cp 1 rows 5-15.
    # Only tp rank 0 of each shard (ranks 0, 2) receives; ranks 1, 3 get the rows by broadcast.
    mb = one_sample(20, (7, 16, 1))
    plan = plan_boundary([mb], encoder=EncoderLayout(dp=2), llm=LLMLayout(cp=2, tp=2), hidden=1, element_size=1)
    assert [(t.dst_rank, t.segments) for t in plan.transfers] == [
        (0, (Segment(0, 0, 5),)),
        (2, (Segment(5, 0, 11),)),
    ]
    assert [(e.llm_rank, e.rows) for e in plan.local_rows] == [(0, 5), (1, 5), (2, 11), (3, 11)]
    assert (plan.bytes_forward, plan.bytes_backward) == (16, 16)
    assert plan.traffic().intra_forward == 16
    assert plan.encoder_imbalance == 2.0  # one image, two encoder groups


def test_two_encoder_groups_interleave_into_one_shard():
    # Two samples; images a (3 tokens) and c (3) in sample 0, b (5) in sample 1; no CP.
    # LPT: b -> group 0, then a -> group 1, then c -> group 1 (3 < 5).
    # Local rows: a 0-2, c 3-5, b 6-10. Group 1's output is a then c, group 0's is b.
    samples = (
        PlannedSample(0, 12, (ImageSlot(10, 3, 1), ImageSlot(11, 3, 4))),
        PlannedSample(1, 8, (ImageSlot(12, 5, 1),)),
    )
    mb = PlannedMicrobatch(0, 0, samples)
    plan = plan_boundary([mb], encoder=EncoderLayout(dp=2), llm=LLMLayout(), hidden=1, element_size=1)
    assert [(w.encoder_dp_rank, [im.image_id for im in w.images]) for w in plan.encoder_work] == [
        (0, [12]),
        (1, [10, 11]),
    ]
    assert [(t.src_rank, t.segments) for t in plan.transfers] == [
        (0, (Segment(0, 6, 5),)),
        (1, (Segment(0, 0, 6),)),  # a and c are adjacent on both sides: one segment
    ]
    assert plan.encoder_patches == (5, 6)


def test_encoder_load_carries_across_microbatches():
    mbs = [one_sample(20, (i, 10, 1), index=i) for i in range(4)]
    plan = plan_boundary(mbs, encoder=EncoderLayout(dp=2), llm=LLMLayout(), hidden=1, element_size=1)
    assert [w.encoder_dp_rank for w in plan.encoder_work] == [0, 1, 0, 1]
    assert plan.encoder_imbalance == 1.0


def test_text_only_step_needs_nothing():
    mb = PlannedMicrobatch(0, 0, (PlannedSample(0, 9, ()),))
    plan = plan_boundary([mb], encoder=EncoderLayout(dp=3), llm=LLMLayout(cp=2, tp=2), hidden=4, element_size=2)
    assert (plan.encoder_work, plan.transfers, plan.local_rows) == ((), (), ())
    assert plan.encoder_imbalance == 1.0 and plan.bytes_forward == plan.bytes_backward == 0


def test_leader_broadcast_traffic_counts():
    # 16 rows, tp=2, cp=2: cross 16 each way; broadcast to 3 other ranks; cp reduce from 1 other.
    mb = one_sample(20, (7, 16, 1))
    traffic = leader_broadcast_traffic([mb], llm=LLMLayout(tp=2, cp=2), hidden=1, element_size=1)
    assert (traffic.forward, traffic.backward, traffic.intra_forward, traffic.intra_backward) == (16, 16, 48, 16)


@pytest.mark.parametrize(
    "mb, kwargs, message",
    [
        (one_sample(20, (7, 16, 1), dp_rank=2), {}, "llm_dp_rank 2"),
        (one_sample(20, (7, 16, 1), (8, 2, 10)), {}, "image 8 at position 10"),
        (one_sample(10, (7, 16, 1)), {}, "seq_len 10"),
        (one_sample(20, (7, 0, 1)), {}, "tokens 0"),
    ],
)
def test_bad_input_is_refused_naming_the_value(mb, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_boundary([mb], encoder=EncoderLayout(), llm=LLMLayout(dp=2), hidden=1, element_size=1, **kwargs)


# ---- cross-check on real collated digits batches ------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return make_dataset(DataConfig(multi_image_fraction=0.3, text_only_fraction=0.2))


def planned_sample(dataset, sample_id: int, tokens_per_image: int, first_image_id: int) -> PlannedSample:
    """A sample's slots from its real sequence; image ids renumbered to be unique in the batch."""
    ids, _, positions = build_sequence(dataset.tokenizer, dataset.sample(sample_id), FixedTokens(tokens_per_image))
    starts = positions[::tokens_per_image]
    slots = tuple(ImageSlot(first_image_id + k, tokens_per_image, p) for k, p in enumerate(starts))
    return PlannedSample(sample_id, len(ids), slots)


@pytest.mark.parametrize("tokens_per_image", [4, 16])
@pytest.mark.parametrize("cp, tp, pp", [(1, 2, 1), (2, 1, 1), (2, 2, 1), (3, 2, 1), (2, 1, 2)])
def test_local_rows_match_shard_microbatch_on_digits(digits, tokens_per_image, cp, tp, pp):
    llm, encoder = LLMLayout(cp=cp, tp=tp, dp=2, pp=pp), EncoderLayout(dp=3)
    sample_ids = digits.train_ids[:40]
    microbatches, batches = [], []
    for index in range(5):
        ids = sample_ids[index * 8 : (index + 1) * 8]
        mb_samples, first_image = [], 0
        for s in ids:
            mb_samples.append(planned_sample(digits, s, tokens_per_image, first_image))
            first_image += len(mb_samples[-1].images)
        microbatches.append(PlannedMicrobatch(index, index % llm.dp, tuple(mb_samples)))
        batches.append(collate(digits.tokenizer, [digits.sample(s) for s in ids], FixedTokens(tokens_per_image)))
    assert any(len(s.images) > 1 for mb in microbatches for s in mb.samples)
    assert any(not s.images for mb in microbatches for s in mb.samples)
    plan = plan_of(encoder, llm, microbatches)
    buffers = deliver(plan, microbatches, encoder, llm)
    for mb, batch in zip(microbatches, batches):
        assert batch.image_positions.numel() == n_rows(mb)
        for rank in range(llm.world_size):
            coords = llm.coords(rank)
            if coords["dp"] != mb.llm_dp_rank or coords["pp"] > 0:  # later stages never see image rows
                assert (rank, mb.index) not in buffers
                continue
            local = shard_microbatch(batch, pad_id=digits.tokenizer.pad_id, cp=cp, cp_rank=coords["cp"], tp=tp)
            assert buffers.get((rank, mb.index), []) == local.image_rows_Nl.tolist()
