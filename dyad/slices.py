"""A model's single-device tensors described as recipes over a checkpoint's stored tensors, so that
each rank reads only its own piece of each (its tensor-parallel rows or columns, its experts),
never the whole model.

A recipe (`Source`) has the single-device shape of one model tensor and reads any selection of it:
`read(index)` with one index vector per dim returns `full[index[0]][:, index[1]]...`. The stored
tensor (`Stored`) reads the box the selection spans from its memory-mapped file; the others
(`Transposed`, `Stacked`, `Concatenated`, `Merged`) say how a model tensor is made of stored ones
(an expert weight of one tensor per expert, a fused q/k/v of three, a patch embedding of four dims
flattened to two) and pass each selection on to what they are made of.

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


def everything(shape: Sequence[int]) -> Index:
    return tuple(torch.arange(n) for n in shape)


class Source(ABC):
    shape: tuple[int, ...]

    @abstractmethod
    def read(self, index: Index) -> torch.Tensor:
        """The selection `index` of the full tensor, shaped [len(i) for i in index]."""

    def full(self) -> torch.Tensor:
        return self.read(everything(self.shape))


class Stored(Source):
    """A tensor of a checkpoint file, read through a safetensors slice (`handle.get_slice(name)`):
    only the box spanning the selection leaves the memory-mapped file."""

    def __init__(self, handle, name: str, shape: tuple[int, ...]):
        self.handle, self.name, self.shape = handle, name, tuple(shape)

    def read(self, index: Index) -> torch.Tensor:
        if not index:  # a scalar
            return self.handle.get_slice(self.name)[:]
        starts = [int(i.min()) if len(i) else 0 for i in index]
        box = tuple(slice(start, int(i.max()) + 1 if len(i) else 0) for start, i in zip(starts, index))
        value = self.handle.get_slice(self.name)[box]
        for dim, (start, i) in enumerate(zip(starts, index)):
            if len(i) != value.shape[dim] or not torch.equal(i, torch.arange(start, start + len(i))):
                value = value.index_select(dim, i - start)
        return value


class Transposed(Source):
    """A 2-D tensor stored transposed."""

    def __init__(self, source: Source):
        self.source, self.shape = source, source.shape[::-1]

    def read(self, index: Index) -> torch.Tensor:
        return self.source.read(index[::-1]).T


class Stacked(Source):
    """Equal-shaped tensors stacked along a new `dim` (one expert's weight each, say)."""

    def __init__(self, sources: Sequence[Source], dim: int = 0):
        self.sources, self.dim = list(sources), dim
        part = self.sources[0].shape
        if any(s.shape != part for s in self.sources):
            raise ValueError(f"stacked tensors differ in shape: {sorted({s.shape for s in self.sources})}")
        self.shape = (*part[:dim], len(self.sources), *part[dim:])

    def read(self, index: Index) -> torch.Tensor:
        rest = index[: self.dim] + index[self.dim + 1 :]
        return torch.stack([self.sources[int(i)].read(rest) for i in index[self.dim]], self.dim)


class Concatenated(Source):
    """Tensors concatenated along `dim` (q, k and v of a fused projection, say)."""

    def __init__(self, sources: Sequence[Source], dim: int = 0):
        self.sources, self.dim = list(sources), dim
        self.starts = [0]
        for source in self.sources:
            self.starts.append(self.starts[-1] + source.shape[dim])
        self.shape = (*self.sources[0].shape[:dim], self.starts[-1], *self.sources[0].shape[dim + 1 :])

    def read(self, index: Index) -> torch.Tensor:
        wanted = index[self.dim]
        owner = torch.bucketize(wanted, torch.tensor(self.starts[1:]), right=True)
        pieces, order = [], []
        for part, source in enumerate(self.sources):
            mine = (owner == part).nonzero().flatten()
            if len(mine) or part == 0:  # the first read even when empty: the value's dtype
                local = index[: self.dim] + (wanted[mine] - self.starts[part],) + index[self.dim + 1 :]
                pieces.append(source.read(local))
                order.append(mine)
        value = torch.cat(pieces, self.dim)  # grouped by part: put back in the order asked
        return value.index_select(self.dim, torch.cat(order).argsort())


class Merged(Source):
    """Dims `dim` and `dim + 1` of a tensor flattened into one (row-major, as reshape does)."""

    def __init__(self, source: Source, dim: int):
        self.source, self.dim = source, dim
        shape = source.shape
        self.inner = shape[dim + 1]
        self.shape = (*shape[:dim], shape[dim] * shape[dim + 1], *shape[dim + 2 :])

    def read(self, index: Index) -> torch.Tensor:
        wanted = index[self.dim]
        outer, outer_at = torch.unique(wanted // self.inner, return_inverse=True)
        inner, inner_at = torch.unique(wanted % self.inner, return_inverse=True)
        value = self.source.read(index[: self.dim] + (outer, inner) + index[self.dim + 1 :])
        return value.flatten(self.dim, self.dim + 1).index_select(self.dim, outer_at * len(inner) + inner_at)


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
    as this rank holds it, read from its source, and into each buffer named there its whole. `rows`: parameters whose single-device tensor has
    more rows than their source (a vocabulary grown past the checkpoint's): the rows past the
    source's keep their values; so do the padding rows of a piece."""
    loaded = set()
    for key, buffer in model.named_buffers():  # a buffer is whole on every rank (an expert bias)
        if key in sources:
            with torch.no_grad():
                buffer.copy_(sources[key].full().to(buffer.device, buffer.dtype))
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
            held_rows = stored.nonzero().flatten().to(param.device)
            with torch.no_grad():  # read on the host, memory-mapped: copied to the parameter's device
                param[held_rows] = source.read(index).to(param.device, param.dtype)
        elif not index:
            with torch.no_grad():
                param.copy_(source.read(()))
    assert loaded == set(sources), f"no tensor of the model for {sorted(set(sources) - loaded)[:3]}"
