"""Parallel layouts of the two pools: degrees, validation, rank <-> coordinate maps and the
rank lists of every process group.

Pure math, no torch: the router plans with the same objects the services use, and
`dyad.parallel.groups` turns `groups(name)` into process groups once.
Rank order: the first axis listed is the fastest-varying (tp fastest), i.e.
rank = sum(coord[axis] * stride[axis]) with stride[first axis] = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from math import prod
from typing import ClassVar


def _check_positive(section: str, layout) -> None:
    for field in fields(layout):
        value = getattr(layout, field.name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{section}.{field.name} must be a positive integer, got {value!r}")


def _coords(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    coords = {}
    for axis, size in sizes.items():
        coords[axis] = rank % size
        rank //= size
    return coords


def _rank(coords: dict[str, int], sizes: dict[str, int]) -> int:
    rank, stride = 0, 1
    for axis, size in sizes.items():
        if not 0 <= coords[axis] < size:
            raise ValueError(f"coordinate {axis}={coords[axis]} outside [0, {size})")
        rank += coords[axis] * stride
        stride *= size
    return rank


def group_ranks(axes: dict[str, int], varying: Sequence[str]) -> list[list[int]]:
    """The groups of ranks that differ only in the `varying` axes (all other axes fixed).

    `axes` maps axis -> size, fastest first. Each group is sorted ascending, so a rank's index in
    its group is its coordinate over the varying axes (first varying axis fastest); groups are
    ordered by their smallest rank.
    """
    unknown = [axis for axis in varying if axis not in axes]
    if unknown:
        raise ValueError(f"unknown axes {unknown}; valid axes: {', '.join(axes)}")
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(prod(axes.values())):  # ascending, so every group comes out sorted
        fixed = tuple(c for axis, c in _coords(rank, axes).items() if axis not in varying)
        groups.setdefault(fixed, []).append(rank)
    return sorted(groups.values(), key=lambda group: group[0])


def _named_groups(section: str, views: dict[str, dict[str, int]], table, name: str) -> list[list[int]]:
    if name not in table:
        raise ValueError(f"{section}: unknown group {name!r}; valid names: {', '.join(table)}")
    view, varying = table[name]
    return group_ranks(views[view], varying)


@dataclass(frozen=True, kw_only=True)
class EncoderLayout:
    """The encoder pool: `dp × tp`, tp fastest."""

    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        _check_positive("parallel.encoder", self)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def axes(self) -> dict[str, int]:
        return {"tp": self.tp, "dp": self.dp}

    def coords(self, rank: int) -> dict[str, int]:
        return _coords(rank, self.axes())

    def rank(self, **coords: int) -> int:
        return _rank(coords, self.axes())

    # group name -> (view, varying axes)
    _GROUPS: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {
        "tp": ("encoder", ("tp",)),
        "dp": ("encoder", ("dp",)),
        "world": ("encoder", ("tp", "dp")),
    }
    GROUP_NAMES: ClassVar[tuple[str, ...]] = tuple(_GROUPS)  # also the order groups are built in

    def groups(self, name: str) -> list[list[int]]:
        """All groups of the named kind (see `GROUP_NAMES`), as sorted global ranks."""
        return _named_groups("parallel.encoder", {"encoder": self.axes()}, self._GROUPS, name)


@dataclass(frozen=True, kw_only=True)
class LLMLayout:
    """The LLM pool, folded: attention view `tp × cp × dp`, expert view `etp × ep × edp`.

    Both views cover the same ranks, so `tp·cp·dp == etp·ep·edp`; edp is derived.
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        _check_positive("parallel.llm", self)
        if self.world_size % (self.etp * self.ep) != 0:
            raise ValueError(
                f"parallel.llm: etp*ep ({self.etp}*{self.ep}) must divide "
                f"tp*cp*dp ({self.tp}*{self.cp}*{self.dp} = {self.world_size})"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep)

    def attention_axes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp}

    def expert_axes(self) -> dict[str, int]:
        return {"etp": self.etp, "ep": self.ep, "edp": self.edp}

    def coords(self, rank: int) -> dict[str, int]:
        return _coords(rank, self.attention_axes()) | _coords(rank, self.expert_axes())

    def rank(self, **coords: int) -> int:
        return _rank(coords, self.attention_axes())

    # group name -> (view, varying axes). dp_cp reduces dense gradients, edp expert gradients;
    # tp_cp spans one data-parallel replica, ep_etp the ranks that hold all experts once.
    _GROUPS: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {
        "tp": ("attention", ("tp",)),
        "cp": ("attention", ("cp",)),
        "dp": ("attention", ("dp",)),
        "dp_cp": ("attention", ("cp", "dp")),
        "tp_cp": ("attention", ("tp", "cp")),
        "world": ("attention", ("tp", "cp", "dp")),
        "etp": ("expert", ("etp",)),
        "ep": ("expert", ("ep",)),
        "edp": ("expert", ("edp",)),
        "ep_etp": ("expert", ("etp", "ep")),
    }
    GROUP_NAMES: ClassVar[tuple[str, ...]] = tuple(_GROUPS)  # also the order groups are built in

    def groups(self, name: str) -> list[list[int]]:
        """All groups of the named kind (see `GROUP_NAMES`), as sorted global ranks."""
        views = {"attention": self.attention_axes(), "expert": self.expert_axes()}
        return _named_groups("parallel.llm", views, self._GROUPS, name)


def _check_divides(section: str, axis: str, degree: int, field: str, value: int) -> None:
    if value % degree:
        raise ValueError(f"{section}: {axis} ({degree}) must divide {field} ({value})")


def validate_llm_layout(layout: LLMLayout, llm_cfg) -> None:
    """Refuse a layout that cannot shard this model (an `LLMConfig`), naming both values."""
    section, moe = "parallel.llm", llm_cfg.moe
    _check_divides(section, "tp", layout.tp, "n_heads", llm_cfg.n_heads)
    _check_divides(section, "tp", layout.tp, "n_kv_heads", llm_cfg.n_kv_heads)
    _check_divides(section, "tp", layout.tp, "dense_ffn_dim", llm_cfg.dense_ffn_dim)
    if moe.shared_expert_dim > 0:
        _check_divides(section, "tp", layout.tp, "moe.shared_expert_dim", moe.shared_expert_dim)
    if moe.num_experts % layout.ep:
        raise ValueError(f"{section}: num_experts ({moe.num_experts}) must be divisible by ep ({layout.ep})")
    _check_divides(section, "etp", layout.etp, "moe.expert_dim", moe.expert_dim)


def validate_encoder_layout(layout: EncoderLayout, enc_cfg) -> None:
    """Refuse a layout that cannot shard this encoder (an `EncoderConfig` or a
    `Qwen3VLVisionConfig`: each names the widths tensor parallelism splits, `tp_split`)."""
    for field, value in enc_cfg.tp_split.items():
        _check_divides("parallel.encoder", "tp", layout.tp, field, value)
