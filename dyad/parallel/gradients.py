"""What every pool does with gradients after backward, whatever its layout: sum each parameter's
gradient over its group, measure the pool's gradient norm counting each distinct value once, and
gather sharded tensors back to the single-device shapes (for checks and checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dyad.byte_runs import byte_runs
from dyad.kernels.master_weights import master_of, released
from dyad.optim import sq_norm
from dyad.parallel.buckets import BUCKET_BYTES
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.sharded import ShardedParameters


def sharded_by(module: nn.Module | None, name: str) -> ShardedParameters | None:
    """The parallel counterpart that cut `module.<name>`: the module itself (a tensor-parallel
    layer) or a part of it (expert parallelism's, which cuts its MoE layer's expert weights);
    None where every rank holds the tensor whole (and for a buffer, whose module is None)."""
    if module is None:
        return None
    for part in (module, *module.children()):
        if isinstance(part, ShardedParameters) and part.cuts(module, name):
            return part
    return None


def is_sharded(module: nn.Module, name: str) -> bool:
    """Whether `module.<name>` holds a different piece on each rank of the groups it is cut over."""
    return sharded_by(module, name) is not None


@dataclass
class GradientPlan:
    """Which group each parameter's gradient is summed over, and which of them this rank's group
    counts in the pool's gradient norm: every rank of a group holds the same sum (or, with the
    optimizer sharded, its own part of it), and `counted` leaves out what another group holds too
    (a tensor-parallel replica's), so that each distinct value counts exactly once in the pool."""

    reduce_over: dict[str, list[nn.Parameter]] = field(default_factory=dict)
    counted: list[nn.Parameter] = field(default_factory=list)

    def trained(self) -> GradientPlan:
        """The plan of the parameters that train (`requires_grad`; `train.freeze` holds the others)."""
        return GradientPlan(
            reduce_over={group: [p for p in params if p.requires_grad] for group, params in self.reduce_over.items()},
            counted=[p for p in self.counted if p.requires_grad],
        )


def reduce_gradients(plan: GradientPlan, groups: ProcessGroups, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum gradients over each parameter's group, in place (a parameter without one gets zeros
    first), a bucket of them per all-reduce."""
    for name, params in plan.reduce_over.items():
        if groups.size(name) == 1:
            continue
        for bucket in gradient_buckets(grads_or_zeros(params), bucket_bytes):
            _all_reduce_in_place(bucket, groups.group(name))


def grads_or_zeros(params: list[nn.Parameter]):
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        yield param.grad


def gradient_buckets(grads, bucket_bytes: int):
    """Consecutive gradients (or parameters, which have their gradients' sizes) of one dtype and
    device, at most `bucket_bytes` together; a larger one is a bucket of its own."""
    return byte_runs(grads, lambda grad: grad.numel() * grad.element_size(), bucket_bytes,
                     kind=lambda grad: (grad.dtype, grad.device))


def _all_reduce_in_place(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    _, flat = start_all_reduce(grads, group, async_op=False)
    if flat is not None:
        copy_back(flat, grads)


def start_all_reduce(grads: list[torch.Tensor], group: dist.ProcessGroup, *, async_op: bool):
    """Sum `grads` over `group`: one contiguous gradient in place, several in a flat copy that
    `copy_back` returns to them once the work is done. Returns (work or None, the copy or None)."""
    if len(grads) == 1 and grads[0].is_contiguous():
        return dist.all_reduce(grads[0], group=group, async_op=async_op), None
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    return dist.all_reduce(flat, group=group, async_op=async_op), flat


def copy_back(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """The inverse of `torch.cat([grad.reshape(-1) for grad in grads])`, into the grads."""
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def pool_grad_sq_norm(plan: GradientPlan, groups: ProcessGroups, device: torch.device | None = None) -> float:
    """Squared norm of the whole pool's gradient (float64), the same on every rank, from the sums
    `reduce_gradients` leaves in place: the first rank of each group counts its group's.
    `device`: where to sum it when the plan has no parameter (a frozen pool's), default its
    parameters'."""
    device = next((p.device for params in plan.reduce_over.values() for p in params), device)
    counted = {id(p) for p in plan.counted}
    mine = [p.grad for name, params in plan.reduce_over.items() if groups.index(name) == 0
            for p in params if id(p) in counted and p.grad is not None]
    total = sq_norm(mine, device)  # a rank may count nothing
    dist.all_reduce(total, group=groups.group("world"))
    return float(total)


def full_tensors(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) gathered back to the single-device model's full shape,
    under the single-device names. Collective: every rank of the pool calls it."""
    full = {}
    for key, module, name, param in owned_parameters(model):
        assert grads or not released(param), f"{key}: its values are the sharded optimizer's (ShardedOptimizer.value)"
        value = param.grad if grads else param
        value = torch.zeros_like(param) if value is None else value.detach()
        full[key] = gather_full(module, name, value)
    return full


def owned_parameters(model: nn.Module):
    """(single-device key, owning module, attribute name, parameter), in registration order; for
    a bf16 working weight (`dyad/working_weights.py`) the parameter is its float32 master (whose
    values, with the optimizer sharded, only the sharded optimizer has)."""
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            master = master_of(param)
            yield (f"{module_name}.{name}" if module_name else name), module, name, param if master is None else master


def gather_full(module, name, value):
    """`value`, shaped like `module.<name>` on this rank, gathered to the single-device shape by
    the counterpart that cut the parameter (collective over the groups it holds)."""
    counterpart = sharded_by(module, name)
    return value if counterpart is None else counterpart.gather_full(name, value)


def local_part(module, name, full):
    """The inverse of `gather_full`: this rank's piece of the single-device tensor `full` (a
    parameter `module.<name>` or a tensor shaped like it, e.g. an AdamW moment), cut as the
    pool's `parallelize` cut the parameter."""
    counterpart = sharded_by(module, name)
    return full if counterpart is None else counterpart.local_part(name, full)
