"""Optimizer and gradient math shared by every service and the single-process reference.

Both sides call the same functions, so the disaggregated run and the reference do the same
arithmetic in the same order.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from dyad.kernels.fp8 import forget_quantized_after_each_step

CLIP_EPS = 1e-6  # as in torch.nn.utils.clip_grad_norm_


def build_optimizer(model: nn.Module, train) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norms, biases) do not. Fused on a GPU."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # On a GPU the fused kernel updates each tensor in one pass over its four float32 arrays
    # (the multi-tensor default makes several): a third of a 1B-active MoE step otherwise.
    on_gpu = any(p.is_cuda for p in model.parameters())
    optimizer = torch.optim.AdamW(
        groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, fused=on_gpu or None
    )
    forget_quantized_after_each_step(optimizer)  # float8 weight codes (llm.fp8) follow the update
    return optimizer


def grad_sq_norm(params: Iterable[nn.Parameter]) -> float:
    """Sum of squared gradient entries, accumulated in float64."""
    squares = [p.grad.detach().double().pow(2).sum() for p in params if p.grad is not None]
    return float(torch.stack(squares).sum()) if squares else 0.0


def clip_scale(total_sq_norm: float, max_norm: float) -> float:
    """The factor every gradient is multiplied by to clip the global norm to `max_norm`."""
    return min(1.0, max_norm / (math.sqrt(total_sq_norm) + CLIP_EPS))


def apply_update(optimizer: torch.optim.Optimizer, *, lr: float, grad_scale: float) -> None:
    if grad_scale != 1.0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
