"""Parallel layouts of the two pools: degrees, validation and rank <-> coordinate maps.

Pure math, no torch: the router plans with the same objects the services use.
Rank order: the first axis listed is the fastest-varying (tp fastest), i.e.
rank = sum(coord[axis] * stride[axis]) with stride[first axis] = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Layouts the running system executes today: one rank per pool. Wider layouts validate and
# map ranks already (the planner and tests use them); their execution comes with the folded
# parallelism of the services.
MAX_EXECUTABLE_WORLD = 1


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


def check_executable(encoder: EncoderLayout, llm: LLMLayout) -> None:
    """Refuse layouts the services cannot run yet, naming the field."""
    for section, layout in (("parallel.encoder", encoder), ("parallel.llm", llm)):
        if layout.world_size > MAX_EXECUTABLE_WORLD:
            sizes = " x ".join(f"{k}={v}" for k, v in vars(layout).items())
            raise ValueError(
                f"{section} ({sizes}) has {layout.world_size} ranks; this release runs "
                f"{MAX_EXECUTABLE_WORLD} rank per pool"
            )

