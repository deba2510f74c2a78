"""What the encoder and LLM workers share: the model and its optimizer, the update, the save.

Each pool's worker (`encoder_service.worker`, `llm_service.worker`) adds its own step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from dyad.config import RunConfig
from dyad.data import make_dataset
from dyad.init import init_parameters
from dyad.optim import apply_update, build_optimizer, grad_sq_norm
from dyad.transport import Transport
from dyad.wire import pb

# Each pool's weights come from its own stream of the run seed, whatever the layout.
_POOL_SEED_OFFSET = {"encoder": 1, "llm": 2}


def build_model(config: RunConfig, pool: str) -> nn.Module:
    """The pool's single-device model with its layout-independent initial weights."""
    if pool == "encoder":
        from dyad.encoder_service.model import VisionEncoder

        model = VisionEncoder(config.encoder)
    else:
        from dyad.llm_service.model import MoELM

        model = MoELM(config.llm)
    init_parameters(model, config.seed * 10 + _POOL_SEED_OFFSET[pool])
    return model.to(config.train.device)


def compute_context(config: RunConfig):
    """Autocast for bfloat16 runs; float32 runs compute in float32."""
    if config.train.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(config.train.device, dtype=torch.bfloat16)


def boundary_dtype(config: RunConfig) -> torch.dtype:
    return getattr(torch, config.train.dtype)


class PoolService:
    pool = ""

    def __init__(self, config: RunConfig, transport: Transport, rank: int, run_id: str):
        self.config = config
        self.transport = transport
        self.rank = rank
        self.run_id = run_id
        self.device = torch.device(config.train.device)
        self.dataset = make_dataset(config.data)
        self.model = build_model(config, self.pool)
        self.optimizer = build_optimizer(self.model, config.train)
        self.peers: dict[tuple[int, int], str] = {}
        self.lr = config.train.lr

    def setup(self, command: pb.SetupCommand) -> None:
        self.peers = {(p.worker.pool, p.worker.rank): p.data_address for p in command.peers}

    def grad_sq_norm(self) -> float:
        return grad_sq_norm(self.model.parameters())

    def apply(self, command: pb.ApplyCommand) -> pb.ApplyResult:
        apply_update(self.optimizer, lr=self.lr, grad_scale=command.grad_scale)
        return pb.ApplyResult(step=command.step)

    def save(self, command: pb.SaveCommand) -> pb.SaveResult:
        path = Path(command.path) / f"{self.pool}-rank{self.rank:03d}.pt"
        state = {
            "step": command.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }
        torch.save(state, path)
        return pb.SaveResult(step=command.step, path=str(path))

    def close(self) -> None:
        pass
