"""A third pool type that lives only in the tests: an "audio" encoder (frames of features to rows
of the LLM's width) on a `dp` layout. It is declared and registered the way a service package
declares one (`dyad.pools`); nothing outside tests/ knows it.

Legend: B clips, T frames, C features, H hidden dim, D the LLM's dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from dyad.layout import group_ranks
from dyad.parallel.gradients import GradientPlan
from dyad.pools import PoolType
from dyad.service import PoolService
from dyad.wire import pb

WIRE_ID = 7  # no `Pool` value of dyad.proto: proto3 enums are open


@dataclass(kw_only=True)
class AudioConfig:
    frames: int = 8
    features: int = 4
    hidden: int = 16
    out_dim: int = 0  # the LLM's dim, derived by `resolve`

    def __post_init__(self):
        for name in ("frames", "features", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"audio.{name} ({getattr(self, name)}) must be >= 1")


@dataclass(frozen=True, kw_only=True)
class AudioLayout:
    dp: int = 1

    def __post_init__(self):
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"parallel.audio.dp must be a positive integer, got {self.dp!r}")

    @property
    def world_size(self) -> int:
        return self.dp

    GROUP_NAMES: ClassVar[tuple[str, ...]] = ("dp", "world")
    PARAMETER_GROUP: ClassVar[str] = "world"

    def coords(self, rank: int) -> dict[str, int]:
        return {"dp": rank}

    def groups(self, name: str) -> list[list[int]]:
        return group_ranks({"dp": self.dp}, ("dp",))


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.proj_in = nn.Linear(cfg.features, cfg.hidden)
        self.proj_out = nn.Linear(cfg.hidden, cfg.out_dim)

    def forward(self, clips_BTC: torch.Tensor) -> torch.Tensor:
        return self.proj_out(torch.nn.functional.gelu(self.proj_in(clips_BTC)))  # B T D


def clips(config, step: int) -> torch.Tensor:
    """The step's global batch of clips, the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    cfg = config.audio
    return torch.randn(config.train.global_batch, cfg.frames, cfg.features, generator=generator)


def clip_loss(model: nn.Module, clips_BTC: torch.Tensor, global_batch: int) -> torch.Tensor:
    """Summed over these clips, normalised by the global batch: data-parallel ranks' gradients
    add up to the whole batch's."""
    return model(clips_BTC).square().mean(dim=(1, 2)).sum() / global_batch


class AudioService(PoolService):
    pool = "audio"

    @staticmethod
    def single_device_model(config) -> AudioEncoder:
        return AudioEncoder(config.audio)

    def parallelize(self, model, groups):
        params = list(model.parameters())
        return GradientPlan(reduce_over={"dp": params}, counted=params)

    def step(self, command: pb.StepCommand) -> pb.StepResult:
        self.lr = command.lr
        batch_BTC = clips(self.config, command.step).chunk(self.groups.size("dp"))[self.groups.index("dp")]
        self.reduction.arm()
        clip_loss(self.model, batch_BTC, self.config.train.global_batch).backward()
        return pb.StepResult(step=command.step, grad_sq_norm=self.finish_backward())


def _resolve(run, vocab_size):
    return dataclasses.replace(run.audio, out_dim=run.llm.dim)


def _scale(run, replicas):
    return dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, audio=AudioLayout(dp=replicas)))


AUDIO = PoolType(
    name="audio",
    wire=WIRE_ID,
    config=AudioConfig,
    layout=AudioLayout,
    resolve=_resolve,
    scale=_scale,
    seed_offset=3,
    service=f"{__name__}:AudioService",
)
