"""The process groups of one pool, built once from its layout.

    dist.init_process_group(...)
    groups = ProcessGroups.build(layout)
    dist.all_reduce(grad, group=groups.group("dp_cp"))

`build` is the only caller of `dist.new_group` in dyad: torch requires every rank to create every
group, in the same order, so each rank walks all groups of every name in `layout.GROUP_NAMES`
order and keeps the one it belongs to. Axes of size 1 still get a real single-rank group
(`new_group([rank])`), so callers never special-case them: a collective over it is a no-op copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist


class Layout(Protocol):
    """What groups are built from: any pool type's layout (`dyad.layout`'s, say)."""

    GROUP_NAMES: tuple[str, ...]  # every kind of group, in the order they are built
    # the group whose ranks hold the same parameters, each its own pieces of them: the pool's
    # "world", or one pipeline stage
    PARAMETER_GROUP: str

    @property
    def world_size(self) -> int: ...

    def coords(self, rank: int) -> dict[str, int]: ...

    def groups(self, name: str) -> list[list[int]]: ...


@dataclass(frozen=True)
class ProcessGroups:
    layout: Layout
    rank: int
    _groups: dict[str, dist.ProcessGroup]
    _ranks: dict[str, list[int]]

    @classmethod
    def build(cls, layout: Layout) -> ProcessGroups:
        world_size = dist.get_world_size()
        if world_size != layout.world_size:
            raise ValueError(
                f"the process group has world size {world_size}, but the layout {layout} "
                f"needs world_size {layout.world_size}"
            )
        rank = dist.get_rank()
        groups, ranks = {}, {}
        for name in layout.GROUP_NAMES:
            for members in layout.groups(name):
                group = dist.new_group(members)  # collective over the world: every rank calls it
                if rank in members:
                    groups[name], ranks[name] = group, members
        return cls(layout, rank, groups, ranks)

    def group(self, name: str) -> dist.ProcessGroup:
        """This rank's group of the named kind; a single-rank group for an axis of size 1."""
        self._check(name)
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's group, ascending."""
        self._check(name)
        return list(self._ranks[name])

    def size(self, name: str) -> int:
        self._check(name)
        return len(self._ranks[name])

    def index(self, name: str) -> int:
        """This rank's index inside its group (its rank in `group(name)`)."""
        self._check(name)
        return self._ranks[name].index(self.rank)

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    def _check(self, name: str) -> None:
        if name not in self._groups:
            raise ValueError(f"unknown group {name!r}; valid names: {', '.join(self.layout.GROUP_NAMES)}")
