"""The minimal boundary plan: which encoder group encodes which image, and exactly which of its
output rows go to which LLM rank, for every microbatch of a step.

A pure function of plain data (no torch, no sockets), so the router plans and tests check it
without a pool. Two independent decisions:

1. Encoder work. Images (not microbatches) are spread over the encoder dp groups by patches:
   per microbatch, longest first onto the group with the least patches so far in the step.
   A group's output for a microbatch ("source rows") is its images' rows in global order.
2. Delivery. An LLM rank gets only the image rows whose sequence position falls in its
   context-parallel shard, as `shard_microbatch` lays them out; tensor-parallel replicas get them
   over the boundary ("direct") or from their tp rank 0 inside the LLM pool ("broadcast"). The
   tp-rank-0 receiver of each shard returns the gradient of those rows, so each row's gradient
   goes back exactly once.

Rows of one microbatch, "global image-row order": samples in batch order, then images in
sequence order, then tokens. A rank's local row k is the k-th global row in its shard.
A transfer maps source rows to local rows with `Segment(src_row, dst_row, length)` runs, maximal
(no two can merge); the gradient goes back along the same segments with the roles swapped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dyad.layout import EncoderLayout, LLMLayout

TP_DELIVERIES = ("direct", "broadcast")


# ---- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSlot:
    image_id: int
    tokens: int  # rows the encoder produces for this image
    position: int  # sequence position of its first token; it fills position..position+tokens-1


@dataclass(frozen=True)
class PlannedSample:
    sample_id: int
    seq_len: int  # the full sequence (text and image tokens)
    images: tuple[ImageSlot, ...]  # in sequence order


@dataclass(frozen=True)
class PlannedMicrobatch:
    index: int
    llm_dp_rank: int  # the LLM data-parallel lane that trains on it
    samples: tuple[PlannedSample, ...]  # batch rows b = 0..B-1


# ---- the plan -----------------------------------------------------------------------------------


class EncodedImage(NamedTuple):
    image_id: int
    tokens: int


class Segment(NamedTuple):
    src_row: int  # row of the encoder group's output for the microbatch
    dst_row: int  # local image row of the receiving LLM rank
    length: int


@dataclass(frozen=True)
class EncoderWork:
    encoder_dp_rank: int
    microbatch: int
    images: tuple[EncodedImage, ...]  # in global image-row order; their rows are the source rows

    @property
    def rows(self) -> int:
        return sum(image.tokens for image in self.images)


@dataclass(frozen=True)
class Transfer:
    src_rank: int  # encoder rank: tp rank 0 of the encoding group
    dst_rank: int  # LLM rank
    microbatch: int
    segments: tuple[Segment, ...]  # ascending in both src_row and dst_row
    returns_gradient: bool  # the receiver sends these rows' gradient back along the segments

    @property
    def rows(self) -> int:
        return sum(segment.length for segment in self.segments)


@dataclass(frozen=True)
class LocalRows:
    llm_rank: int
    microbatch: int
    rows: int  # the rank's local image rows: the buffer it allocates and splices


@dataclass(frozen=True)
class Traffic:
    """Bytes of one step. `forward`/`backward` cross the boundary (encoder pool <-> LLM pool);
    `intra_*` move inside the LLM pool (broadcasts to tp/cp replicas, reductions onto leaders)."""

    forward: int
    backward: int
    intra_forward: int
    intra_backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.intra_forward + self.intra_backward


@dataclass(frozen=True)
class BoundaryPlan:
    """Only what exists is listed: no entry means no images, no rows, no transfer."""

    hidden: int
    element_size: int
    tp_delivery: str
    encoder_work: tuple[EncoderWork, ...]  # by microbatch, then encoder dp rank
    transfers: tuple[Transfer, ...]  # by microbatch, then src_rank, then dst_rank
    local_rows: tuple[LocalRows, ...]  # by microbatch, then llm_rank
    encoder_patches: tuple[int, ...]  # per encoder dp group: its patches over the whole step
    encoder_imbalance: float  # max / mean of encoder_patches; 1.0 when even (and for no images)

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.element_size

    @property
    def bytes_forward(self) -> int:
        return sum(t.rows for t in self.transfers) * self.row_bytes

    @property
    def bytes_backward(self) -> int:
        return sum(t.rows for t in self.transfers if t.returns_gradient) * self.row_bytes

    def traffic(self) -> Traffic:
        # Local rows not received over the boundary come from the tp-rank-0 broadcast.
        local = sum(entry.rows for entry in self.local_rows) * self.row_bytes
        return Traffic(self.bytes_forward, self.bytes_backward, local - self.bytes_forward, 0)


# ---- shard geometry (mirrors llm_service/sharding.py and dyad/parallel/context.py) --------------


def padded_length(seq_len: int, *, cp: int, tp: int) -> int:
    """The microbatch's padded sequence: a multiple of 2·cp·tp under CP, else of tp."""
    multiple = 2 * cp * tp if cp > 1 else tp
    return -(-seq_len // multiple) * multiple


def shard_spans(padded_len: int, *, cp: int, cp_rank: int) -> tuple[tuple[int, int], ...]:
    """The [start, stop) position ranges `cp_rank` holds, ascending (zig-zag: chunks r, 2cp-1-r)."""
    if cp == 1:
        return ((0, padded_len),)
    chunk = padded_len // (2 * cp)
    second = 2 * cp - 1 - cp_rank
    return ((cp_rank * chunk, (cp_rank + 1) * chunk), (second * chunk, (second + 1) * chunk))


# ---- planning -----------------------------------------------------------------------------------


def plan_boundary(
    microbatches: Sequence[PlannedMicrobatch],
    *,
    encoder: EncoderLayout,
    llm: LLMLayout,
    hidden: int,
    element_size: int,
    tp_delivery: str = "direct",
) -> BoundaryPlan:
    _check_inputs(microbatches, llm, hidden, element_size, tp_delivery)
    patches = [0] * encoder.dp  # carried over the step's microbatches, in the order given
    work, transfers, local_rows = [], [], []
    for mb in microbatches:
        tokens = [image.tokens for sample in mb.samples for image in sample.images]
        group_of = _assign_images(tokens, patches)
        work += _encoder_work(mb, group_of, encoder.dp)
        mb_transfers, mb_rows = _deliver(mb, group_of, encoder, llm, tp_delivery)
        transfers += mb_transfers
        local_rows += mb_rows
    return BoundaryPlan(
        hidden=hidden,
        element_size=element_size,
        tp_delivery=tp_delivery,
        encoder_work=tuple(work),
        transfers=tuple(transfers),
        local_rows=tuple(local_rows),
        encoder_patches=tuple(patches),
        encoder_imbalance=_imbalance(patches),
    )


def _assign_images(tokens: list[int], patches: list[int]) -> list[int]:
    """Longest first onto the least-loaded group (ties: lower global image index, then lower
    group); `patches` is updated in place. List scheduling bounds every group's step total by
    mean + (1 - 1/groups) · largest image, whatever came before."""
    group_of = [0] * len(tokens)
    for image in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        group = min(range(len(patches)), key=lambda g: (patches[g], g))
        group_of[image] = group
        patches[group] += tokens[image]
    return group_of


def _encoder_work(mb: PlannedMicrobatch, group_of: list[int], groups: int) -> list[EncoderWork]:
    images = [image for sample in mb.samples for image in sample.images]
    per_group: list[list[EncodedImage]] = [[] for _ in range(groups)]
    for image, group in zip(images, group_of):
        per_group[group].append(EncodedImage(image.image_id, image.tokens))
    return [EncoderWork(g, mb.index, tuple(work)) for g, work in enumerate(per_group) if work]


def _deliver(mb, group_of, encoder, llm, tp_delivery) -> tuple[list[Transfer], list[LocalRows]]:
    if not group_of:  # a text-only microbatch needs nothing from the encoder
        return [], []
    padded = padded_length(max(s.seq_len for s in mb.samples), cp=llm.cp, tp=llm.tp)
    transfers, local_rows = [], []
    for cp_rank in range(llm.cp):
        spans = shard_spans(padded, cp=llm.cp, cp_rank=cp_rank)
        segments, rows = _shard_segments(mb, group_of, spans)
        receivers = range(llm.tp) if tp_delivery == "direct" else range(1)
        for group, group_segments in segments.items():
            for tp_rank in receivers:
                transfers.append(
                    Transfer(
                        src_rank=encoder.rank(tp=0, dp=group),
                        dst_rank=llm.rank(tp=tp_rank, cp=cp_rank, dp=mb.llm_dp_rank),
                        microbatch=mb.index,
                        segments=tuple(group_segments),
                        returns_gradient=tp_rank == 0,
                    )
                )
        if rows:
            local_rows += [
                LocalRows(llm.rank(tp=tp_rank, cp=cp_rank, dp=mb.llm_dp_rank), mb.index, rows)
                for tp_rank in range(llm.tp)
            ]
    transfers.sort(key=lambda t: (t.src_rank, t.dst_rank))
    local_rows.sort(key=lambda entry: entry.llm_rank)
    return transfers, local_rows


def _shard_segments(mb, group_of, spans) -> tuple[dict[int, list[Segment]], int]:
    """Per encoder group, the maximal segments of its source rows that land in `spans`; and the
    shard's local row count. Walking images in global order keeps src and dst rows ascending."""
    segments: dict[int, list[Segment]] = {}
    src_next = [0] * (max(group_of) + 1)  # each group's next source row
    dst_next = 0
    images = (image for sample in mb.samples for image in sample.images)
    for image, group in zip(images, group_of):
        for start, stop in spans:
            lo, hi = max(start, image.position), min(stop, image.position + image.tokens)
            if lo < hi:
                src_row = src_next[group] + lo - image.position
                _append(segments.setdefault(group, []), Segment(src_row, dst_next, hi - lo))
                dst_next += hi - lo
        src_next[group] += image.tokens
    return segments, dst_next


def _append(segments: list[Segment], new: Segment) -> None:
    if segments:
        last = segments[-1]
        if last.src_row + last.length == new.src_row and last.dst_row + last.length == new.dst_row:
            segments[-1] = last._replace(length=last.length + new.length)
            return
    segments.append(new)


def _imbalance(patches: list[int]) -> float:
    total = sum(patches)
    return 1.0 if total == 0 else max(patches) * len(patches) / total


def _check_inputs(microbatches, llm, hidden, element_size, tp_delivery) -> None:
    if tp_delivery not in TP_DELIVERIES:
        raise ValueError(f"tp_delivery must be one of {TP_DELIVERIES}, got {tp_delivery!r}")
    for name, value in (("hidden", hidden), ("element_size", element_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    indices = [mb.index for mb in microbatches]
    if len(set(indices)) != len(indices):
        raise ValueError(f"microbatch indices must be unique, got {indices}")
    for mb in microbatches:
        if not 0 <= mb.llm_dp_rank < llm.dp:
            raise ValueError(
                f"microbatch {mb.index}: llm_dp_rank {mb.llm_dp_rank} outside [0, {llm.dp})"
            )
        for sample in mb.samples:
            _check_sample(sample)


def _check_sample(sample: PlannedSample) -> None:
    end = 0  # images are in sequence order and do not overlap
    for image in sample.images:
        if image.tokens < 1:
            raise ValueError(
                f"sample {sample.sample_id}: image {image.image_id} has tokens {image.tokens} < 1"
            )
        if image.position < end or image.position + image.tokens > sample.seq_len:
            raise ValueError(
                f"sample {sample.sample_id}: image {image.image_id} at position {image.position} "
                f"({image.tokens} tokens) overlaps an earlier image or ends past seq_len "
                f"{sample.seq_len}"
            )
        end = image.position + image.tokens


# ---- byte counts --------------------------------------------------------------------------------


def _image_rows(microbatches: Sequence[PlannedMicrobatch]) -> int:
    return sum(im.tokens for mb in microbatches for sample in mb.samples for im in sample.images)


def minimum_bytes(
    microbatches: Sequence[PlannedMicrobatch],
    *,
    llm: LLMLayout,
    hidden: int,
    element_size: int,
    tp_delivery: str,
) -> tuple[int, int]:
    """(forward, backward) boundary bytes no plan can beat: every row reaches each LLM rank that
    must get it over the boundary (its shard's tp ranks for "direct", one for "broadcast"), and
    every row's gradient returns once."""
    if tp_delivery not in TP_DELIVERIES:
        raise ValueError(f"tp_delivery must be one of {TP_DELIVERIES}, got {tp_delivery!r}")
    receivers = llm.tp if tp_delivery == "direct" else 1
    rows = _image_rows(microbatches)
    return rows * receivers * hidden * element_size, rows * hidden * element_size


def leader_broadcast_traffic(
    microbatches: Sequence[PlannedMicrobatch], *, llm: LLMLayout, hidden: int, element_size: int
) -> Traffic:
    """The same step through a Megatron-MIMO-style bridge: one leader per encoder dp lane sends its
    whole output to one leader per LLM dp lane (each row crosses once, whatever the dp ratio);
    that leader broadcasts the whole image sequence to the other tp·cp - 1 ranks of its lane;
    backward, the other cp - 1 shards' full-size gradients are SUM-reduced onto the leader (tp
    replicas hold the same gradient and do not take part), which sends each row back once.
    Counting rule: a broadcast to k receivers moves k payloads, a reduce of k+1 contributors
    onto one moves k payloads (what the receivers, resp. the non-roots, transfer, whatever the
    algorithm). Encoder-side tp broadcasts of the returned gradient are the same in both designs
    and left out of both."""
    row_bytes = hidden * element_size
    rows = _image_rows(microbatches) * row_bytes
    return Traffic(rows, rows, rows * (llm.tp * llm.cp - 1), rows * (llm.cp - 1))
