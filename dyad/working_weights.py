"""bf16 working weights, cast from their float32 master weights once per optimizer step.

Under autocast, every microbatch's forward pass casts each float32 matrix a matmul uses to
bf16, and its backward pass upcasts the matrix's bf16 gradient to float32 before autograd adds it
into `.grad`: 24 bytes of memory traffic a parameter a microbatch (the step with and without
working weights: docs/performance.md, "LLM service training step, one H200").
`WorkingWeights` registers a bf16 copy of each such matrix in its module in the master's place,
so eager code and compiled blocks alike multiply with it directly; a hook adds each working
weight's bf16 gradient into its master's float32 `.grad` as autograd accumulates it, and
`refresh()` copies the masters into the working weights after each update. The gradients are
those of autocast's casts at each use, bit for bit: the same bf16 products, upcast exactly and
summed in float32 in the same order (tests/integration/test_working_weights.py).

The masters keep every other role of the parameters: the optimizer (`trained_parameters`), the
gradient norm, the gradient reduction (`register_accumulated_hook`) and checkpoints
(`dyad.parallel.gradients.owned_parameters`) see only them; the working weights hold no state of
their own. With the optimizer sharded (`train.shard_optimizer`,
`dyad/parallel/sharded_optimizer.py`) each rank keeps only its piece of a master's values, the
master only its shape and gradient, and the sharded optimizer all-gathers each update straight
into the working weights: `refresh` is not used there. The matrices chosen are the weights of Linear layers (tensor-parallel ones included)
and the MoE layers' expert weights, except the routers', which compute in float32 with autocast
off. `train.working_weights` applies this to both pools (`dyad/service.py`); `bench/llm_step.py`'s
`-working-weights` variants to the LLM alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from dyad.kernels.master_weights import MASTER_ATTRIBUTE as _MASTER
from dyad.kernels.master_weights import WORKING_ATTRIBUTE as _WORKING
from dyad.kernels.master_weights import master_of
from dyad.kernels.widen import add_widened_, widened
from dyad.parallel.tensor import ColumnParallelLinear, RowParallelLinear

LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)  # modules whose `weight` a matmul reads
FLOAT32_SUBMODULES = ("router",)  # modules that compute in float32 under autocast: not cast
_EXPERT_WEIGHTS = ("w13_ED2F", "w2_EFD")



class WorkingWeights:
    """The model's bf16 working weights and their float32 masters (see the module docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.masters_by_name: dict[str, nn.Parameter] = {}
        self.working: list[nn.Parameter] = []
        for qualified, module, name in _cast_matrices(model):
            master = module._parameters[name]
            working = nn.Parameter(master.detach().to(dtype), requires_grad=master.requires_grad)
            working.register_post_accumulate_grad_hook(_adder_into(master))
            module._parameters[name] = working
            setattr(working, _MASTER, master)
            setattr(master, _WORKING, working)
            self.masters_by_name[qualified] = master
            self.working.append(working)

    def masters(self) -> list[nn.Parameter]:
        return [master_of(w) for w in self.working]

    def refresh_after_each_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Refresh the working weights whenever `optimizer` (over the masters) has stepped."""
        optimizer.register_step_post_hook(lambda *_: self.refresh())

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the masters into the working weights (after each update of the masters)."""
        if self.working:
            torch._foreach_copy_(self.working, self.masters())


def trained_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What an optimizer updates: the model's parameters with each working weight's master in
    its place."""
    masters = [master_of(p) for p in model.parameters()]
    return [p if master is None else master for p, master in zip(model.parameters(), masters)]


def _cast_matrices(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    skipped = {
        id(sub)
        for prefix, module in model.named_modules()
        if prefix.rsplit(".", 1)[-1] in FLOAT32_SUBMODULES
        for sub in module.modules()
    }
    for prefix, module in model.named_modules():
        if id(module) in skipped:
            continue
        names = ["weight"] if isinstance(module, LINEARS) else [n for n in _EXPERT_WEIGHTS if n in module._parameters]
        for name in names:
            if module._parameters.get(name) is not None and module._parameters[name].dtype == torch.float32:
                yield f"{prefix}.{name}" if prefix else name, module, name


def _adder_into(master: nn.Parameter):
    def add_into_master(working: nn.Parameter) -> None:
        if master.grad is None:
            master.grad = widened(working.grad)
        else:
            add_widened_(master.grad, working.grad)
        working.grad = None

    return add_into_master
