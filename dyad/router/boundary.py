"""The minimal boundary plan: which encoder group encodes which image, and exactly which of its
output rows go to which LLM rank, for every microbatch of a step.

A pure function of plain data (no torch, no sockets), so the router plans and tests check it
without a pool. Two independent decisions:

1. Encoder work. Images (not microbatches) are spread over the encoder dp groups by cost
   (`image_cost` of their tokens: `dyad.router.encoder_cost`, a tower's multiply-adds; by default
   the tokens): per microbatch, costliest first onto the group with the least cost so far in the
   step.
   A group's output for a microbatch ("source rows") is its images' rows in global order.
2. Delivery. An LLM rank gets only the image rows whose sequence position falls in its
   context-parallel shard (`dyad.sequence_shards`, as `shard_microbatch` lays them out), and
   only a rank of the first pipeline stage, which splices them: the other stages never see
   encoder traffic. Only tp rank 0 of each shard receives them over the boundary; it broadcasts
   them to its tensor-parallel replicas inside the LLM pool and returns their gradient, so each
   row crosses once each way.

Rows of one microbatch, "global image-row order": samples in batch order, then images in
sequence order, then tokens. A rank's local row k is the k-th global row in its shard.
A transfer maps source rows to local rows with `Segment(src_row, dst_row, length)` runs, maximal
(no two can merge); the gradient goes back along the same segments with the roles swapped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dyad.layout import EncoderLayout, LLMLayout
from dyad.sequence_shards import sequence_shard

# ---- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSlot:
    image_id: int
    tokens: int  # rows the encoder produces for this image
    position: int  # sequence position of its first token; it fills position..position+tokens-1
    grid: tuple[int, int, int] | None = None  # its tokens' (frames, rows, columns), where the tower gives one


@dataclass(frozen=True)
class PlannedSample:
    """One row of a microbatch: a sample, or several packed one after another (train.seq_len;
    `sample_id` then its first's)."""

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
    grid: tuple[int, int, int] | None = None  # as ImageSlot's


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
    dst_rank: int  # LLM rank: tp rank 0 of a first-stage shard, which sends the rows' gradient back
    microbatch: int
    segments: tuple[Segment, ...]  # ascending in both src_row and dst_row

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
    encoder_work: tuple[EncoderWork, ...]  # by microbatch, then encoder dp rank
    transfers: tuple[Transfer, ...]  # by microbatch, then src_rank, then dst_rank
    local_rows: tuple[LocalRows, ...]  # by microbatch, then llm_rank
    encoder_patches: tuple[int, ...]  # per encoder dp group: its image rows over the whole step
    encoder_imbalance: float  # max / mean of the groups' cost; 1.0 when even (and for no images)
    encoder_cost: tuple[float, ...] = ()  # per encoder dp group: its images' cost over the step

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.element_size

    @property
    def bytes_forward(self) -> int:
        return sum(t.rows for t in self.transfers) * self.row_bytes

    @property
    def bytes_backward(self) -> int:
        return self.bytes_forward  # every transfer's rows return as gradient

    def traffic(self) -> Traffic:
        # Local rows not received over the boundary come from the tp-rank-0 broadcast.
        local = sum(entry.rows for entry in self.local_rows) * self.row_bytes
        return Traffic(self.bytes_forward, self.bytes_backward, local - self.bytes_forward, 0)


# ---- planning -----------------------------------------------------------------------------------


def plan_boundary(
    microbatches: Sequence[PlannedMicrobatch],
    *,
    encoder: EncoderLayout,
    llm: LLMLayout,
    hidden: int,
    element_size: int,
    image_cost: Callable[[int], float] = float,
) -> BoundaryPlan:
    """`image_cost(tokens)`: what an image of that many rows costs its encoder group."""
    _check_inputs(microbatches, llm, hidden, element_size)
    patches = [0] * encoder.dp
    costs = [0.0] * encoder.dp  # carried over the step's microbatches, in the order given
    work, transfers, local_rows = [], [], []
    for mb in microbatches:
        tokens = [image.tokens for sample in mb.samples for image in sample.images]
        group_of = _assign_images([image_cost(t) for t in tokens], costs)
        for image, group in enumerate(group_of):
            patches[group] += tokens[image]
        work += _encoder_work(mb, group_of, encoder.dp)
        mb_transfers, mb_rows = _deliver(mb, group_of, encoder, llm)
        transfers += mb_transfers
        local_rows += mb_rows
    return BoundaryPlan(
        hidden=hidden,
        element_size=element_size,
        encoder_work=tuple(work),
        transfers=tuple(transfers),
        local_rows=tuple(local_rows),
        encoder_patches=tuple(patches),
        encoder_imbalance=_imbalance(costs),
        encoder_cost=tuple(costs),
    )


def _assign_images(costs: list[float], loads: list[float]) -> list[int]:
    """Costliest first onto the least-loaded group (ties: lower global image index, then lower
    group); `loads` is updated in place. List scheduling bounds every group's step total by
    mean + (1 - 1/groups) · costliest image, whatever came before."""
    group_of = [0] * len(costs)
    for image in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        group = min(range(len(loads)), key=lambda g: (loads[g], g))
        group_of[image] = group
        loads[group] += costs[image]
    return group_of


def _encoder_work(mb: PlannedMicrobatch, group_of: list[int], groups: int) -> list[EncoderWork]:
    images = [image for sample in mb.samples for image in sample.images]
    per_group: list[list[EncodedImage]] = [[] for _ in range(groups)]
    for image, group in zip(images, group_of):
        per_group[group].append(EncodedImage(image.image_id, image.tokens, image.grid))
    return [EncoderWork(g, mb.index, tuple(work)) for g, work in enumerate(per_group) if work]


def _deliver(mb, group_of, encoder, llm) -> tuple[list[Transfer], list[LocalRows]]:
    if not group_of:  # a text-only microbatch needs nothing from the encoder
        return [], []
    seq_len = max(s.seq_len for s in mb.samples)
    transfers, local_rows = [], []
    for cp_rank in range(llm.cp):
        spans = sequence_shard(seq_len, cp=llm.cp, tp=llm.tp, cp_rank=cp_rank).spans
        segments, rows = _shard_segments(mb, group_of, spans)
        for group, group_segments in segments.items():
            transfers.append(
                Transfer(
                    src_rank=encoder.rank(tp=0, dp=group),
                    dst_rank=llm.rank(tp=0, cp=cp_rank, dp=mb.llm_dp_rank, pp=0),
                    microbatch=mb.index,
                    segments=tuple(group_segments),
                )
            )
        if rows:
            local_rows += [
                LocalRows(llm.rank(tp=tp_rank, cp=cp_rank, dp=mb.llm_dp_rank, pp=0), mb.index, rows)
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
        for span in spans:
            lo, hi = max(span.start, image.position), min(span.stop, image.position + image.tokens)
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


def _imbalance(loads: list[float]) -> float:
    total = sum(loads)
    return 1.0 if total == 0 else max(loads) * len(loads) / total


def _check_inputs(microbatches, llm, hidden, element_size) -> None:
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
    microbatches: Sequence[PlannedMicrobatch], *, hidden: int, element_size: int
) -> tuple[int, int]:
    """(forward, backward) boundary bytes no plan can beat: every row crosses once to the one
    LLM rank of its shard that receives it (tp replicas get it from that rank's broadcast), and
    every row's gradient returns once."""
    nbytes = _image_rows(microbatches) * hidden * element_size
    return nbytes, nbytes


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
