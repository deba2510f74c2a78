"""A model's single-device tensors described as recipes over a checkpoint's stored tensors, so that
each rank reads only its own piece of each (its tensor-parallel rows or columns, its experts),
never the whole model.

A recipe (`Source`) has the single-device shape of one model tensor and reads any selection of it:
`read(index)` with one index vector per dim returns `full[index[0]][:, index[1]]...`, on the
`device` asked for: the stored boxes go there as they are read (in the checkpoint's dtype), and the
recipes' transposes, stacks and interleaves run there. The stored tensor (`Stored`) reads the box
the selection spans from its memory-mapped file; the others
(`Transposed`, `Permuted`, `Stacked`, `Concatenated`, `Merged`, `Split`) say how a model tensor is
made of stored ones (an expert weight of one tensor per expert, a fused q/k/v of three, a patch
embedding of four dims flattened to two, the gate and up projections of every expert fused in one)
and pass each selection on to what they are made of.

Which piece a rank holds is its parallel counterpart's fact (`local_part`, which cuts a full
tensor); `load_pieces` asks it by cutting index tensors (`_held_indices`) rather than values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from dyad.parallel.gradients import local_part, owned_parameters

Index = tuple[torch.Tensor, ...]  # one int64 vector per dim: the positions read along it
Device = torch.device | str | None


def everything(shape: Sequence[int]) -> Index:
    return tuple(torch.arange(n) for n in shape)


def _select(value: torch.Tensor, dim: int, positions: torch.Tensor) -> torch.Tensor:
    """`value`'s entries at `positions` (on the host) along `dim`: `value` itself where that is
    all of them in order (no copy of a whole tensor)."""
    if len(positions) == value.shape[dim] and torch.equal(positions, torch.arange(len(positions))):
        return value
    return value.index_select(dim, positions.to(value.device))


class Source(ABC):
    shape: tuple[int, ...]

    @abstractmethod
    def read(self, index: Index, device: Device = None) -> torch.Tensor:
        """The selection `index` (host tensors) of the full tensor, shaped [len(i) for i in index],
        on `device` (None: the host)."""

    def full(self, device: Device = None) -> torch.Tensor:
        return self.read(everything(self.shape), device)


class Stored(Source):
    """A tensor of a checkpoint file, read through a safetensors slice (`handle.get_slice(name)`):
    only the box spanning the selection leaves the memory-mapped file."""

    def __init__(self, handle, name: str, shape: tuple[int, ...]):
        self.handle, self.name, self.shape = handle, name, tuple(shape)

    def read(self, index: Index, device: Device = None) -> torch.Tensor:
        if not index:  # a scalar
            return self.handle.get_slice(self.name)[:].to(device)
        starts = [int(i.min()) if len(i) else 0 for i in index]
        box = tuple(slice(start, int(i.max()) + 1 if len(i) else 0) for start, i in zip(starts, index))
        value = self.handle.get_slice(self.name)[box].to(device)
        for dim, (start, i) in enumerate(zip(starts, index)):
            value = _select(value, dim, i - start)
        return value


class Transposed(Source):
    """A 2-D tensor stored transposed."""

    def __init__(self, source: Source):
        self.source, self.shape = source, source.shape[::-1]

    def read(self, index: Index, device: Device = None) -> torch.Tensor:
        return self.source.read(index[::-1], device).T


class Permuted(Source):
    """A tensor stored with its dims in another order: dim i here is the stored tensor's dims[i]
    (as `torch.permute`)."""

    def __init__(self, source: Source, dims: Sequence[int]):
        self.source, self.dims = source, tuple(dims)
        self.shape = tuple(source.shape[d] for d in self.dims)

    def read(self, index: Index, device: Device = None) -> torch.Tensor:
        stored = [None] * len(self.dims)
        for mine, theirs in enumerate(self.dims):
            stored[theirs] = index[mine]
        return self.source.read(tuple(stored), device).permute(self.dims)


class Split(Source):
    """Dim `dim` of a tensor seen as two, (parts, its size / parts), row-major as `unflatten`
    does: the inverse of `Merged`."""

    def __init__(self, source: Source, dim: int, parts: int):
        self.source, self.dim = source, dim
        shape = source.shape
        assert shape[dim] % parts == 0, f"{parts} parts of {shape[dim]}"
        self.inner = shape[dim] // parts
        self.shape = (*shape[:dim], parts, self.inner, *shape[dim + 1 :])

    def read(self, index: Index, device: Device = None) -> torch.Tensor:
        # one read a part: the box of each spans only its own selection (an expert-tensor-parallel
        # rank's columns of the gate rows, then of the up rows), not the rows between them
        before, (outer, inner), after = index[: self.dim], index[self.dim : self.dim + 2], index[self.dim + 2 :]
        if not len(outer):
            return self.source.read(before + (outer,) + after, device).unflatten(self.dim, (0, len(inner)))
        parts = [self.source.read(before + (int(o) * self.inner + inner,) + after, device) for o in outer]
        return torch.stack(parts, self.dim)


class Stacked(Source):
    """Equal-shaped tensors stacked along a new `dim` (one expert's weight each, say)."""

    def __init__(self, sources: Sequence[Source], dim: int = 0):
        self.sources, self.dim = list(sources), dim
        part = self.sources[0].shape
        if any(s.shape != part for s in self.sources):
            raise ValueError(f"stacked tensors differ in shape: {sorted({s.shape for s in self.sources})}")
        self.shape = (*part[:dim], len(self.sources), *part[dim:])

    def read(self, index: Index, device: Device = None) -> torch.Tensor:
        rest = index[: self.dim] + index[self.dim + 1 :]
        return torch.stack([self.sources[int(i)].read(rest, device) for i in index[self.dim]], self.dim)


class Concatenated(Source):
    """Tensors concatenated along `dim` (q, k and v of a fused projection, say)."""

    def __init__(self, sources: Sequence[Source], dim: int = 0):
        self.sources, self.dim = list(sources), dim
        self.starts = [0]
        for source in self.sources:
            self.starts.append(self.starts[-1] + source.shape[dim])
        self.shape = (*self.sources[0].shape[:dim], self.starts[-1], *self.sources[0].shape[dim + 1 :])

    def read(self, index: Index, device: Device = None) -> torch.Tensor:
        wanted = index[self.dim]
        owner = torch.bucketize(wanted, torch.tensor(self.starts[1:]), right=True)
        pieces, order = [], []
        for part, source in enumerate(self.sources):
            mine = (owner == part).nonzero().flatten()
            if len(mine) or part == 0:  # the first read even when empty: the value's dtype
                local = index[: self.dim] + (wanted[mine] - self.starts[part],) + index[self.dim + 1 :]
                pieces.append(source.read(local, device))
                order.append(mine)
        value = torch.cat(pieces, self.dim)  # grouped by part: put back in the order asked
        return _select(value, self.dim, torch.cat(order).argsort())


class Merged(Source):
    """Dims `dim` and `dim + 1` of a tensor flattened into one (row-major, as reshape does)."""

    def __init__(self, source: Source, dim: int):
        self.source, self.dim = source, dim
        shape = source.shape
        self.inner = shape[dim + 1]
        self.shape = (*shape[:dim], shape[dim] * shape[dim + 1], *shape[dim + 2 :])

    def read(self, index: Index, device: Device = None) -> torch.Tensor:
        wanted = index[self.dim]
        outer, outer_at = torch.unique(wanted // self.inner, return_inverse=True)
        inner, inner_at = torch.unique(wanted % self.inner, return_inverse=True)
        value = self.source.read(index[: self.dim] + (outer, inner) + index[self.dim + 1 :], device)
        return _select(value.flatten(self.dim, self.dim + 1), self.dim, outer_at * len(inner) + inner_at)


def _held_indices(module: nn.Module, name: str, shape: tuple[int, ...]) -> Index:
    """Per dim, the positions of the single-device tensor (of `shape`) that this rank's piece of
    `module.<name>` holds, -1 where the piece is padding: the counterpart's `local_part` applied
    to tensors of position + 1, broadcast along the other dims (no value is read to learn it)."""
    held = []
    for dim, n in enumerate(shape):
        along = [1] * len(shape)
        along[dim] = n
        positions = torch.arange(1, n + 1, dtype=torch.int32).view(along).expand(shape)
        piece = local_part(module, name, positions)
        held.append(piece[tuple(slice(None) if d == dim else 0 for d in range(len(shape)))].long() - 1)
    return tuple(held)


def load_pieces(model: nn.Module, sources: Mapping[str, Source], *, rows: Mapping[str, int] = {}) -> None:
    """Copy into each of `model`'s parameters named in `sources` (single-device names) its piece
    as this rank holds it, read from its source, and into each buffer named there its whole.
    `rows`: parameters whose single-device tensor has more rows than their source (a vocabulary
    grown past the checkpoint's): the rows past the source's keep their values; so do the padding
    rows of a piece."""
    loaded = set()
    for key, buffer in model.named_buffers():  # a buffer is whole on every rank (an expert bias)
        if key in sources:
            with torch.no_grad():
                buffer.copy_(sources[key].full(buffer.device).to(buffer.dtype))
            loaded.add(key)
    for key, module, name, param in owned_parameters(model):
        if key not in sources:
            continue
        loaded.add(key)
        source = sources[key]
        full_shape = (rows.get(key, source.shape[0]), *source.shape[1:]) if source.shape else ()
        index = _held_indices(module, name, full_shape)
        if index and index[0].numel():
            stored = (index[0] >= 0) & (index[0] < source.shape[0])
            index = (index[0][stored], *index[1:])
            # each box copied to the parameter's device in the checkpoint's dtype (half the bytes of
            # a float32 parameter's), put in the model's layout and converted there
            value = source.read(index, param.device).to(param.dtype)
            with torch.no_grad():
                if bool(stored.all()):
                    param.copy_(value)
                else:
                    param[stored.nonzero().flatten().to(param.device)] = value
        elif not index:
            with torch.no_grad():
                param.copy_(source.read((), param.device))
    assert loaded == set(sources), f"no tensor of the model for {sorted(set(sources) - loaded)[:3]}"
