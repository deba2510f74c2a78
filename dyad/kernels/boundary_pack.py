"""Pack row segments into one contiguous message buffer and unpack them in place on arrival.

Legend: R rows of a source or destination tensor, N rows of a message buffer, D row width
(any trailing shape works; only dim 0 is indexed).

A segment `(src_row, dst_row, length)` moves rows `src_row : src_row + length` of the sender's
tensor to rows `dst_row : dst_row + length` of the receiver's. The buffer holds the segments'
rows back to back in segment order, so one segment list describes both ends and nothing about
the layout travels beside the bytes. Gradients come back through `segments.reversed()`: the
receiver packs the gradient rows it was sent, the sender `unpack_add`s them into its gradient
buffer (several peers' messages may add into the same rows, one call each).

Segment rules, checked once when a `RowSegments` is built:
- rows are non-negative and lengths positive: a zero-length segment is rejected, not skipped,
  because it can only come from a planner bug; planners drop empty moves before building one;
- destination ranges do not overlap. For `unpack_into` an overlap would make the result depend
  on write order, and for `unpack_add` on CUDA it would make `index_add_` sum one row's
  contributions with atomics in arbitrary order, losing bit-exactness. Source ranges may
  overlap (a row packed twice is harmless), but then `reversed()` is rejected for the same reason.

Autograd: `pack` without `out`, `unpack_into` and `unpack_add` are ordinary differentiable
ops (`index_select`, `index_copy_`, `index_add_`), so inputs that require grad keep their
graph; an in-place unpack into a leaf that requires grad raises, as any in-place op does. The
send path packs detached tensors into a preallocated `out`; torch refuses `out=` when the input
requires grad (RuntimeError), so a graph is never cut silently. The `*_reference` versions do
the same with a Python loop of slice copies and must agree bit for bit.
"""

from dataclasses import dataclass, field
from itertools import pairwise

import torch

from dyad.kernels.host_to_device import to_device

Segment = tuple[int, int, int]  # (src_row, dst_row, length)


@dataclass(frozen=True, eq=False)
class RowSegments:
    """One message's segments, validated, with their row indices precomputed on `device`."""

    segments: tuple[Segment, ...]
    device: torch.device | str = "cpu"  # stored as a torch.device
    num_rows: int = field(init=False)  # N, the buffer's rows
    min_src_rows: int = field(init=False)  # the sender's tensor needs at least this many rows
    min_dst_rows: int = field(init=False)
    src_index_N: torch.Tensor = field(init=False, repr=False)
    dst_index_N: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        segments = tuple((int(s), int(d), int(n)) for s, d, n in self.segments)
        for i, (src_row, dst_row, length) in enumerate(segments):
            if src_row < 0 or dst_row < 0 or length <= 0:
                raise ValueError(
                    f"segment {i} {segments[i]}: rows must be >= 0 and length > 0 "
                    "(drop empty segments before building RowSegments)"
                )
        _check_disjoint_destinations(segments)
        device = torch.device(self.device)
        derived = {
            "segments": segments,
            "device": device,
            "num_rows": sum(n for _, _, n in segments),
            "min_src_rows": max((s + n for s, _, n in segments), default=0),
            "min_dst_rows": max((d + n for _, d, n in segments), default=0),
            "src_index_N": _row_index([s for s, _, _ in segments], segments, device),
            "dst_index_N": _row_index([d for _, d, _ in segments], segments, device),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def reversed(self) -> "RowSegments":
        """The gradient trip: same buffer layout, source and destination swapped."""
        return RowSegments(tuple((d, s, n) for s, d, n in self.segments), self.device)


def _check_disjoint_destinations(segments: tuple[Segment, ...]) -> None:
    order = sorted(range(len(segments)), key=lambda i: segments[i][1])
    for prev, cur in pairwise(order):
        if segments[cur][1] < segments[prev][1] + segments[prev][2]:
            raise ValueError(
                f"overlapping destination rows: segment {prev} {segments[prev]} and segment {cur} {segments[cur]}"
            )


def _row_index(starts: list[int], segments: tuple[Segment, ...], device: torch.device) -> torch.Tensor:
    """Concatenated aranges start:start+length, built on the CPU and copied to `device` once
    (without waiting for the device's queued kernels)."""
    lengths_S = torch.tensor([n for _, _, n in segments], dtype=torch.int64)
    starts_S = torch.tensor(starts, dtype=torch.int64)
    buffer_starts_S = lengths_S.cumsum(0) - lengths_S
    offsets_N = torch.arange(int(lengths_S.sum())) - buffer_starts_S.repeat_interleave(lengths_S)
    return to_device(starts_S.repeat_interleave(lengths_S) + offsets_N, device)


def _check_rows(tensor: torch.Tensor, rows: int, name: str, exact: bool = False) -> None:
    # Out-of-range rows would be a device-side assert on CUDA; catch them here, on Python ints.
    if tensor.dim() == 0 or (tensor.shape[0] != rows if exact else tensor.shape[0] < rows):
        need = f"exactly {rows}" if exact else f"at least {rows}"
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; the segments need {need} rows")


def _check_out(out: torch.Tensor, rows_RD: torch.Tensor, segments: RowSegments) -> None:
    # index_select(out=) would silently reallocate a mis-shaped `out`, losing its UCX registration.
    shape = (segments.num_rows, *rows_RD.shape[1:])
    if out.shape != shape or out.dtype != rows_RD.dtype or out.device != rows_RD.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {rows_RD.dtype} tensor of shape {shape} on {rows_RD.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )


def pack(rows_RD: torch.Tensor, segments: RowSegments, out: torch.Tensor | None = None) -> torch.Tensor:
    """buffer_ND = the segments' source rows back to back; written into `out` when given."""
    _check_rows(rows_RD, segments.min_src_rows, "rows_RD")
    if out is None:
        return torch.index_select(rows_RD, 0, segments.src_index_N)
    _check_out(out, rows_RD, segments)
    return torch.index_select(rows_RD, 0, segments.src_index_N, out=out)


def unpack_into(buffer_ND: torch.Tensor, dest_RD: torch.Tensor, segments: RowSegments) -> torch.Tensor:
    """dest_RD[segment rows] = buffer rows, in place; returns dest_RD."""
    _check_rows(buffer_ND, segments.num_rows, "buffer_ND", exact=True)
    _check_rows(dest_RD, segments.min_dst_rows, "dest_RD")
    return dest_RD.index_copy_(0, segments.dst_index_N, buffer_ND)


def unpack_add(buffer_ND: torch.Tensor, dest_RD: torch.Tensor, segments: RowSegments) -> torch.Tensor:
    """dest_RD[segment rows] += buffer rows, in place (gradient accumulation); returns dest_RD."""
    _check_rows(buffer_ND, segments.num_rows, "buffer_ND", exact=True)
    _check_rows(dest_RD, segments.min_dst_rows, "dest_RD")
    return dest_RD.index_add_(0, segments.dst_index_N, buffer_ND)


def pack_reference(rows_RD: torch.Tensor, segments: RowSegments, out: torch.Tensor | None = None) -> torch.Tensor:
    _check_rows(rows_RD, segments.min_src_rows, "rows_RD")
    if out is not None:
        _check_out(out, rows_RD, segments)
    buffer_ND = rows_RD.new_empty((segments.num_rows, *rows_RD.shape[1:])) if out is None else out
    position = 0
    for src_row, _, length in segments.segments:
        buffer_ND[position : position + length] = rows_RD[src_row : src_row + length]
        position += length
    return buffer_ND


def unpack_into_reference(buffer_ND: torch.Tensor, dest_RD: torch.Tensor, segments: RowSegments) -> torch.Tensor:
    _check_rows(buffer_ND, segments.num_rows, "buffer_ND", exact=True)
    _check_rows(dest_RD, segments.min_dst_rows, "dest_RD")
    position = 0
    for _, dst_row, length in segments.segments:
        dest_RD[dst_row : dst_row + length] = buffer_ND[position : position + length]
        position += length
    return dest_RD


def unpack_add_reference(buffer_ND: torch.Tensor, dest_RD: torch.Tensor, segments: RowSegments) -> torch.Tensor:
    _check_rows(buffer_ND, segments.num_rows, "buffer_ND", exact=True)
    _check_rows(dest_RD, segments.min_dst_rows, "dest_RD")
    position = 0
    for _, dst_row, length in segments.segments:
        dest_RD[dst_row : dst_row + length] += buffer_ND[position : position + length]
        position += length
    return dest_RD
