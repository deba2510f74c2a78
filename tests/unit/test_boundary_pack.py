"""Boundary packing: the index kernels agree bit for bit with the slice-copy references.

Every parity test runs on CPU and, where a GPU exists, on CUDA; without one the CUDA cases are
skipped with their reason (shown by `pytest -rs`).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dyad.kernels.boundary_pack import (
    RowSegments,
    pack,
    pack_reference,
    unpack_add,
    unpack_add_reference,
    unpack_into,
    unpack_into_reference,
)

D = 6
DTYPES = [torch.float32, torch.bfloat16]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="no CUDA device here: the CUDA path of boundary_pack is not exercised"
        ),
    ),
]
PACKS = {"fast": pack, "reference": pack_reference}
UNPACKS = {"fast": unpack_into, "reference": unpack_into_reference}
ADDS = {"fast": unpack_add, "reference": unpack_add_reference}
HYPOTHESIS = settings(max_examples=25, deadline=None)


@st.composite
def _disjoint_starts(draw, lengths):
    """Start rows for blocks of `lengths`, laid out in random order with gaps; and the rows used."""
    gaps = draw(st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths)))
    starts, row = [0] * len(lengths), 0
    for i in draw(st.permutations(range(len(lengths)))):
        row += gaps[i]
        starts[i] = row
        row += lengths[i]
    return starts, row + draw(st.integers(0, 3))


@st.composite
def plans(draw, disjoint_src=False):
    """(segments, source rows R_src, destination rows R_dst); destinations never overlap."""
    lengths = draw(st.lists(st.integers(1, 5), max_size=8))
    dst, dst_rows = draw(_disjoint_starts(lengths))
    if disjoint_src:
        src, src_rows = draw(_disjoint_starts(lengths))
    else:  # sources may overlap: a row may be packed twice
        src_rows = draw(st.integers(max(lengths, default=0), 24))
        src = [draw(st.integers(0, src_rows - n)) for n in lengths]
    return list(zip(src, dst, lengths)), src_rows, dst_rows


def _random_bits(rows, dtype, seed, device):
    """Arbitrary bit patterns (NaN payloads, infinities, denormals) to prove bit-exactness."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(ints)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, (rows, D), dtype=ints, generator=generator).view(dtype).to(device)


def _random_values(rows, dtype, seed, device):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, D, generator=generator).to(dtype=dtype, device=device)


def _same_bytes(x, y):
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(
        x.cpu().reshape(-1).view(torch.uint8), y.cpu().reshape(-1).view(torch.uint8)
    )


# ---- fast path == reference ------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@HYPOTHESIS
@given(plan=plans(), seed=st.integers(0, 2**31 - 1))
def test_pack_matches_reference(device, dtype, plan, seed):
    segments, src_rows, _ = plan
    rows = RowSegments(segments, device)
    rows_RD = _random_bits(src_rows, dtype, seed, device)
    buffer_ND = pack(rows_RD, rows)
    assert buffer_ND.shape == (rows.num_rows, D) and buffer_ND.is_contiguous()
    assert _same_bytes(buffer_ND, pack_reference(rows_RD, rows))
    out = torch.empty_like(buffer_ND)
    assert _same_bytes(pack(rows_RD, rows, out=out), buffer_ND)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@HYPOTHESIS
@given(plan=plans(), seed=st.integers(0, 2**31 - 1))
def test_unpack_into_matches_reference(device, dtype, plan, seed):
    segments, _, dst_rows = plan
    rows = RowSegments(segments, device)
    buffer_ND = _random_bits(rows.num_rows, dtype, seed, device)
    dest_RD = _random_bits(dst_rows, dtype, seed + 1, device)
    expected = unpack_into_reference(buffer_ND, dest_RD.clone(), rows)
    assert _same_bytes(unpack_into(buffer_ND, dest_RD, rows), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@HYPOTHESIS
@given(plan=plans(), seed=st.integers(0, 2**31 - 1))
def test_unpack_add_matches_reference(device, dtype, plan, seed):
    segments, _, dst_rows = plan
    rows = RowSegments(segments, device)
    grad_RD = _random_values(dst_rows, dtype, seed, device)
    expected = grad_RD.clone()
    for message in range(2):  # two peers' gradients land on the same rows
        buffer_ND = _random_values(rows.num_rows, dtype, seed + 1 + message, device)
        unpack_add(buffer_ND, grad_RD, rows)
        unpack_add_reference(buffer_ND, expected, rows)
    assert _same_bytes(grad_RD, expected)


# ---- semantics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@HYPOTHESIS
@given(plan=plans(disjoint_src=True), seed=st.integers(0, 2**31 - 1))
def test_round_trip_restores_rows(device, dtype, plan, seed):
    segments, src_rows, dst_rows = plan
    there, back = RowSegments(segments, device), RowSegments(segments, device).reversed()
    source_RD = _random_bits(src_rows, dtype, seed, device)
    received_RD = unpack_into(pack(source_RD, there), torch.zeros(dst_rows, D, dtype=dtype, device=device), there)
    restored_RD = unpack_into(pack(received_RD, back), torch.zeros_like(source_RD), back)
    sent = torch.zeros(src_rows, dtype=torch.bool, device=device)
    sent[there.src_index_N] = True
    assert _same_bytes(restored_RD[sent], source_RD[sent])
    assert not restored_RD[~sent].any()


@pytest.mark.parametrize("adds", ADDS.values(), ids=ADDS.keys())
def test_unpack_add_accumulates(adds):
    rows = RowSegments([(0, 1, 2), (5, 4, 1)])  # buffer rows 0,1 -> grad rows 1,2; row 2 -> row 4
    grad_RD = torch.ones(6, D)
    adds(torch.full((3, D), 2.0), grad_RD, rows)
    adds(torch.arange(3.0).unsqueeze(1).expand(3, D), grad_RD, rows)
    expected = torch.tensor([1.0, 3.0, 4.0, 1.0, 5.0, 1.0]).unsqueeze(1).expand(6, D)
    torch.testing.assert_close(grad_RD, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_index_tensors_live_on_the_plan_device(device):
    rows = RowSegments([(4, 0, 2), (0, 2, 1)], device)
    assert rows.num_rows == 3 and rows.min_src_rows == 6 and rows.min_dst_rows == 3
    for index_N in (rows.src_index_N, rows.dst_index_N):
        assert index_N.dtype == torch.int64 and index_N.device.type == torch.device(device).type
    assert rows.src_index_N.tolist() == [4, 5, 0] and rows.dst_index_N.tolist() == [0, 1, 2]


@pytest.mark.parametrize("kind", ["fast", "reference"])
def test_empty_segment_list_moves_nothing(kind):
    rows = RowSegments([])
    assert rows.num_rows == 0
    buffer_ND = PACKS[kind](torch.randn(4, D), rows)
    assert buffer_ND.shape == (0, D)
    dest_RD = torch.randn(4, D)
    before = dest_RD.clone()
    UNPACKS[kind](buffer_ND, dest_RD, rows)
    ADDS[kind](buffer_ND, dest_RD, rows)
    assert torch.equal(dest_RD, before)


@pytest.mark.parametrize("unpacks", UNPACKS.values(), ids=UNPACKS.keys())
def test_unpack_writes_through_a_view(unpacks):
    wide_RF = torch.zeros(5, 2 * D)
    rows = RowSegments([(0, 3, 2)])
    unpacks(torch.ones(2, D), wide_RF[:, D:], rows)  # non-contiguous destination
    assert wide_RF[3:, D:].eq(1).all() and wide_RF.sum() == 2 * D


# ---- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "segments,message",
    [
        ([(0, 0, 2), (3, 4, 0)], r"segment 1 \(3, 4, 0\): rows must be >= 0 and length > 0"),
        ([(-1, 0, 2)], r"segment 0 \(-1, 0, 2\)"),
        ([(0, -3, 2)], r"segment 0 \(0, -3, 2\)"),
        ([(0, 0, -2)], r"segment 0 \(0, 0, -2\)"),
    ],
)
def test_bad_segments_are_rejected(segments, message):
    with pytest.raises(ValueError, match=message):
        RowSegments(segments)


def test_overlapping_destinations_are_rejected_naming_both():
    with pytest.raises(ValueError, match=r"overlapping destination rows: segment 2 \(9, 4, 3\) and segment 0 \(1, 6, 2\)"):
        RowSegments([(1, 6, 2), (0, 0, 2), (9, 4, 3)])
    RowSegments([(1, 6, 2), (0, 0, 2), (9, 4, 2)])  # touching is not overlapping


def test_overlapping_sources_pack_twice_but_cannot_reverse():
    rows = RowSegments([(0, 0, 2), (1, 5, 2)])
    assert pack(torch.arange(3.0).unsqueeze(1), rows).flatten().tolist() == [0.0, 1.0, 1.0, 2.0]
    with pytest.raises(ValueError, match=r"segment 0 \(0, 0, 2\) and segment 1 \(5, 1, 2\)"):
        rows.reversed()


@pytest.mark.parametrize("kind", ["fast", "reference"])
def test_tensors_too_small_are_rejected(kind):
    rows = RowSegments([(2, 3, 2)])
    with pytest.raises(ValueError, match=r"rows_RD has shape \(3, 6\); the segments need at least 4 rows"):
        PACKS[kind](torch.zeros(3, D), rows)
    with pytest.raises(ValueError, match=r"buffer_ND has shape \(3, 6\); the segments need exactly 2 rows"):
        UNPACKS[kind](torch.zeros(3, D), torch.zeros(5, D), rows)
    with pytest.raises(ValueError, match=r"dest_RD has shape \(4, 6\); the segments need at least 5 rows"):
        ADDS[kind](torch.zeros(2, D), torch.zeros(4, D), rows)


# ---- preallocated buffers ----------------------------------------------------------------------


@pytest.mark.parametrize("packs", PACKS.values(), ids=PACKS.keys())
def test_out_is_reused_without_reallocation(packs):
    rows = RowSegments([(3, 0, 2), (0, 2, 1)])
    out = torch.empty(3, D)
    address = out.data_ptr()
    for step in range(3):
        rows_RD = torch.randn(5, D) + step
        buffer_ND = packs(rows_RD, rows, out=out)
        assert buffer_ND.data_ptr() == address and out.data_ptr() == address
        assert torch.equal(out, torch.cat([rows_RD[3:5], rows_RD[0:1]]))


@pytest.mark.parametrize(
    "out",
    [torch.empty(4, D), torch.empty(3, D + 1), torch.empty(3, D, dtype=torch.bfloat16), torch.empty(D, 3).t()],
    ids=["rows", "width", "dtype", "strided"],
)
def test_unusable_out_is_rejected_not_reallocated(out):
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor of shape \(3, 6\)"):
        pack(torch.randn(5, D), RowSegments([(3, 0, 2), (0, 2, 1)]), out=out)


# ---- autograd ----------------------------------------------------------------------------------


def test_pack_keeps_the_graph():
    rows = RowSegments([(3, 0, 2), (0, 2, 2), (1, 5, 1)])  # source row 1 is packed twice
    grads = []
    for packs in PACKS.values():
        x_RD = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
        weight_ND = torch.arange(rows.num_rows * D, dtype=torch.float64).reshape(-1, D)
        (packs(x_RD, rows) * weight_ND).sum().backward()
        grads.append(x_RD.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], weight_ND[3] + weight_ND[4])  # buffer rows 3 and 4 came from row 1


def test_pack_into_out_refuses_an_input_that_requires_grad():
    with pytest.raises(RuntimeError, match="out="):
        pack(torch.randn(5, D, requires_grad=True), RowSegments([(0, 0, 2)]), out=torch.empty(2, D))


@pytest.mark.parametrize("kind", ["fast", "reference"])
def test_unpacks_carry_gradients_to_the_buffer(kind):
    rows = RowSegments([(0, 2, 2), (2, 0, 1)])
    buffer_ND = torch.randn(3, D, requires_grad=True)
    dest_RD = torch.randn(4, D, requires_grad=True)
    copied_RD = UNPACKS[kind](buffer_ND, dest_RD.clone(), rows)
    added_RD = ADDS[kind](buffer_ND, dest_RD.clone(), rows)
    (copied_RD.sum() + 2 * added_RD.sum()).backward()
    torch.testing.assert_close(buffer_ND.grad, torch.full((3, D), 3.0))
    torch.testing.assert_close(dest_RD.grad, torch.tensor([2.0, 3.0, 2.0, 2.0]).unsqueeze(1).expand(4, D))


@pytest.mark.parametrize("kind", ["fast", "reference"])
def test_unpack_into_a_leaf_that_requires_grad_raises(kind):
    rows = RowSegments([(0, 0, 1)])
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        UNPACKS[kind](torch.ones(1, D), torch.zeros(2, D, requires_grad=True), rows)
