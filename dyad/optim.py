"""Optimizer and gradient math shared by every service and the single-process reference.

Both sides call the same functions, so the disaggregated run and the reference do the same
arithmetic in the same order.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from dyad.kernels.fp8 import forget_quantized_after_each_step


def build_optimizer(model: nn.Module | Iterable[nn.Parameter], train) -> torch.optim.AdamW:
    """AdamW over a model's parameters (or the parameters given); matrices decay, vectors
    (norms, biases) do not. Fused on a GPU."""
    params = [p for p in (model.parameters() if isinstance(model, nn.Module) else model) if p.requires_grad]
    return adamw([p for p in params if decays(p)], [p for p in params if not decays(p)], train)


def decays(param: nn.Parameter) -> bool:
    """Whether AdamW's weight decay applies to `param`: to matrices, not to vectors."""
    return param.dim() >= 2


def adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], train) -> torch.optim.AdamW:
    """AdamW at `train`'s hyperparameters over two groups: `decay` (train.weight_decay) and
    `no_decay`, in that order (a checkpoint keeps each group's hyperparameters by its index).
    Fused on a GPU."""
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # On a GPU the fused kernel updates each tensor in one pass over its four float32 arrays
    # (the multi-tensor default makes several): a third of a 1B-active MoE step otherwise.
    on_gpu = any(p.is_cuda for p in [*decay, *no_decay])
    optimizer = torch.optim.AdamW(
        groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, fused=on_gpu or None
    )
    forget_quantized_after_each_step(optimizer)  # float8 weight codes (llm.fp8) follow the update
    return optimizer


def grad_sq_norm(params: Iterable[nn.Parameter]) -> float:
    """Sum of squared gradient entries (see `sq_norm`)."""
    return float(sq_norm([p.grad for p in params if p.grad is not None]))


def sq_norm(tensors: list[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Sum of the squared entries of `tensors`, a float64 scalar on their device (`device` when
    there are none). Each tensor's norm comes from one fused pass over it (float32 accumulation,
    as torch.nn.utils.clip_grad_norm_ computes it) and their squares are summed in float64: a
    float64 copy of every gradient, squared, costs a large LLM a noticeable share of its step."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm([t.detach() for t in tensors], 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


def apply_update(optimizer: torch.optim.Optimizer, *, lr: float, grad_scale: float) -> None:
    """One step of `optimizer` at `lr` on its gradients times `grad_scale`, then no gradients."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    _scale_gradients(optimizer, grad_scale)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def skip_update(optimizer: torch.optim.Optimizer) -> None:
    """No step: the gradients are dropped, and the weights and the optimizer's state (moments,
    step counts) stay as they were (a step whose loss or gradient norm is not finite, which one
    update would spread into every weight through the moments)."""
    optimizer.zero_grad(set_to_none=True)


def _scale_gradients(optimizer: torch.optim.Optimizer, grad_scale: float) -> None:
    """A fused optimizer divides each gradient by its `grad_scale` tensor inside its own pass
    (as torch.amp.GradScaler uses it), so the clipped gradients cost no pass of their own; the
    others multiply them, all in one call."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if _is_fused(optimizer):
        optimizer.grad_scale = None if grad_scale == 1.0 or not grads else torch.full(
            (), 1.0 / grad_scale, dtype=torch.float32, device=grads[0].device
        )
    elif grad_scale != 1.0 and grads:
        torch._foreach_mul_(grads, grad_scale)


def set_step_count(optimizer: torch.optim.Optimizer, tensor: torch.Tensor, step: torch.Tensor) -> None:
    """Set AdamW's step count of `tensor` (a scalar, as a checkpoint keeps it): a fused optimizer
    keeps it beside the tensor, the others on the CPU."""
    optimizer.state[tensor]["step"] = step.to(tensor.device) if _is_fused(optimizer) else step


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return any(group.get("fused") for group in optimizer.param_groups)
