"""How a bf16 working weight and its float32 master name each other (`dyad.working_weights` makes
the pairs): kernels that compute a weight's gradient accumulate it straight into the master, and
the gradient reduction hooks a master through its working weight. A master whose values the
sharded optimizer keeps in pieces (`dyad.parallel.sharded_optimizer`) is `released`: its shape
remains, for its gradient, and no values."""

from __future__ import annotations

import torch
from torch import nn

MASTER_ATTRIBUTE = "_dyad_master"  # the attribute of a working weight that holds its master
WORKING_ATTRIBUTE = "_dyad_working"  # and of a master, its working weight


def master_of(weight: torch.Tensor) -> nn.Parameter | None:
    """The float32 master of a working weight, None for any other tensor."""
    return getattr(weight, MASTER_ATTRIBUTE, None)


def register_accumulated_hook(param: nn.Parameter, hook) -> None:
    """`hook(param)` once autograd has accumulated a gradient into `param.grad`: a post-accumulate
    hook on the parameter, or, for a master (which autograd no longer reaches), on its working
    weight, after the working weight's gradient has been added into the master's."""
    working = getattr(param, WORKING_ATTRIBUTE, None)
    if working is None:
        param.register_post_accumulate_grad_hook(hook)
    else:
        working.register_post_accumulate_grad_hook(lambda _: hook(param))


def release(master: nn.Parameter) -> None:
    """Drop a master's values, keeping its shape, dtype and device (what its gradient is
    accumulated in and checked against): a zero-stride view of one element."""
    master.data = torch.zeros((), dtype=master.dtype, device=master.device).expand(master.shape)


def released(master: torch.Tensor) -> bool:
    """Whether `master` holds no values of its own (`release`)."""
    return master.numel() > 1 and all(stride == 0 for stride in master.stride())
