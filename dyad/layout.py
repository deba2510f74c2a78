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


def _check_positive(section: str, layout, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(layout, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{section}.{name} must be a positive integer, got {value!r}")


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
        _check_positive("parallel.encoder", self, [field.name for field in fields(self)])

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
    PARAMETER_GROUP: ClassVar[str] = "world"  # every rank holds (its pieces of) every parameter

    def groups(self, name: str) -> list[list[int]]:
        """All groups of the named kind (see `GROUP_NAMES`), as sorted global ranks."""
        return _named_groups("parallel.encoder", {"encoder": self.axes()}, self._GROUPS, name)


@dataclass(frozen=True, kw_only=True)
class LLMLayout:
    """The LLM pool: `pp` pipeline stages (pp slowest, so a stage's ranks are contiguous), each
    folded: attention view `tp × cp × dp`, expert view `etp × ep × edp` over the same ranks of the
    stage, so `tp·cp·dp == etp·ep·edp`; edp is derived. Every group but `pp` and `world` lies
    inside one stage.

    The decoder's layers are cut into `pp·pp_virtual` stages in pipeline order: stage s is chunk
    s // pp of pipeline rank s % pp (`rank_stages`), each holding `pp_layers[s]` consecutive
    layers, or an even share when `pp_layers` is empty (`stage_layers`). `pp_virtual > 1` runs
    the interleaved schedule (`dyad.parallel.pipeline`).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    pp_virtual: int = 1  # chunks of layers each pipeline rank holds
    pp_layers: tuple[int, ...] = ()  # layers of each stage in pipeline order; empty: an even split

    _DEGREES: ClassVar[tuple[str, ...]] = ("tp", "cp", "dp", "ep", "etp", "pp", "pp_virtual")

    def __post_init__(self) -> None:
        _check_positive("parallel.llm", self, self._DEGREES)
        if self.stage_size % (self.etp * self.ep) != 0:
            raise ValueError(
                f"parallel.llm: etp*ep ({self.etp}*{self.ep}) must divide "
                f"tp*cp*dp ({self.tp}*{self.cp}*{self.dp} = {self.stage_size})"
            )
        if self.pp_virtual > 1 and self.pp == 1:
            raise ValueError(f"parallel.llm.pp_virtual ({self.pp_virtual}) needs parallel.llm.pp > 1")
        if self.pp_layers:
            if len(self.pp_layers) != self.stages:
                raise ValueError(
                    f"parallel.llm.pp_layers has {len(self.pp_layers)} entries, one per stage: "
                    f"pp*pp_virtual ({self.pp}*{self.pp_virtual} = {self.stages})"
                )
            if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.pp_layers):
                raise ValueError(f"parallel.llm.pp_layers must hold positive integers, got {list(self.pp_layers)}")

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: tp·cp·dp."""
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        return self.stage_size // (self.etp * self.ep)

    @property
    def stages(self) -> int:
        """Pipeline stages, virtual ones counted: pp·pp_virtual."""
        return self.pp * self.pp_virtual

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds, its chunks in order."""
        return [chunk * self.pp + pp_rank for chunk in range(self.pp_virtual)]

    def stage_layers(self, n_layers: int) -> list[range]:
        """Each stage's decoder layers (of `n_layers`), in pipeline order."""
        counts = list(self.pp_layers)
        if not counts:
            if n_layers % self.stages:
                raise ValueError(
                    f"parallel.llm: pp*pp_virtual ({self.pp}*{self.pp_virtual} = {self.stages}) stages must "
                    f"divide n_layers ({n_layers}); parallel.llm.pp_layers splits them unevenly"
                )
            counts = [n_layers // self.stages] * self.stages
        elif sum(counts) != n_layers:
            raise ValueError(f"parallel.llm.pp_layers {list(counts)} sums to {sum(counts)}, not n_layers ({n_layers})")
        starts = [sum(counts[:s]) for s in range(len(counts))]
        return [range(start, start + count) for start, count in zip(starts, counts)]

    def attention_axes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def expert_axes(self) -> dict[str, int]:
        return {"etp": self.etp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    def coords(self, rank: int) -> dict[str, int]:
        return _coords(rank, self.attention_axes()) | _coords(rank, self.expert_axes())

    def rank(self, **coords: int) -> int:
        return _rank(coords, self.attention_axes())

    # group name -> (view, varying axes). dp_cp reduces dense gradients, edp expert gradients;
    # tp_cp spans one data-parallel replica of a stage, ep_etp the ranks of a stage that hold
    # all its experts once, stage all ranks of one stage; pp carries one pipeline's activations.
    _GROUPS: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {
        "tp": ("attention", ("tp",)),
        "cp": ("attention", ("cp",)),
        "dp": ("attention", ("dp",)),
        "dp_cp": ("attention", ("cp", "dp")),
        "tp_cp": ("attention", ("tp", "cp")),
        "stage": ("attention", ("tp", "cp", "dp")),
        "pp": ("attention", ("pp",)),
        "world": ("attention", ("tp", "cp", "dp", "pp")),
        "etp": ("expert", ("etp",)),
        "ep": ("expert", ("ep",)),
        "edp": ("expert", ("edp",)),
        "ep_etp": ("expert", ("etp", "ep")),
    }
    GROUP_NAMES: ClassVar[tuple[str, ...]] = tuple(_GROUPS)  # also the order groups are built in
    PARAMETER_GROUP: ClassVar[str] = "stage"  # a stage's ranks hold its parameters, no other rank does

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
    first_stage = layout.stage_layers(llm_cfg.n_layers)[0]
    if llm_cfg.deepstack_levels > len(first_stage):
        raise ValueError(
            f"{section}: the first pipeline stage holds {len(first_stage)} layers, fewer than llm.deepstack_levels "
            f"({llm_cfg.deepstack_levels}): the image rows, DeepStack's with them, reach that stage alone "
            f"(parallel.llm.pp_layers gives it more)"
        )


def validate_encoder_layout(layout: EncoderLayout, enc_cfg) -> None:
    """Refuse a layout that cannot shard this encoder (an `EncoderConfig` or a
    `Qwen3VLVisionConfig`: each names the widths tensor parallelism splits, `tp_split`)."""
    for field, value in enc_cfg.tp_split.items():
        _check_divides("parallel.encoder", "tp", layout.tp, field, value)
