"""How the layout-parity tests step a parallelized model and its single-device reference: plain
SGD on both, which isolates the layout's math (tests/dist/test_llm_layouts.py says why), or
AdamW on the reference against the optimizer sharded over the model's replicas
(`dyad.parallel.sharded_optimizer`), which must give AdamW's update."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dyad.optim import apply_update, build_optimizer, grad_sq_norm
from dyad.parallel.gradients import full_tensors, gather_full, owned_parameters, pool_grad_sq_norm
from dyad.parallel.overlap import GradientReduction
from dyad.parallel.sharded_optimizer import MOMENTS, ShardedOptimizer
from tests.helpers.parity import assert_tensors_close

SGD_LR, ADAMW_LR = 0.1, 1e-2


class Stepper:
    """The model's gradient reduction (`reduction`: arm it, finish it) and both optimizers.
    `held`: the names of the reference's parameters the model holds (a pipeline stage's; default
    all), which the checks compare."""

    def __init__(self, reference, model, plan, groups, train, shard: bool, bucket_bytes: int, held=None):
        self.reference, self.model, self.plan, self.groups = reference, model, plan, groups
        self.held = set(held) if held is not None else {name for name, _ in reference.named_parameters()}
        self.shards = ShardedOptimizer(plan, groups, train, bucket_bytes) if shard else None
        if shard:
            self.ref_optimizer, self.optimizer = build_optimizer(reference, train), self.shards.adamw
        else:
            self.ref_optimizer = torch.optim.SGD(reference.parameters())
            self.optimizer = torch.optim.SGD(model.parameters())
        self.reduction = GradientReduction(plan, groups, bucket_bytes=bucket_bytes, into=self.shards)
        self.lr = ADAMW_LR if shard else SGD_LR

    def gradients(self) -> dict[str, torch.Tensor]:
        """The model's summed gradients at full shapes, under the single-device names."""
        if self.shards is None:
            return full_tensors(self.model, grads=True)
        return {key: gather_full(module, name, self.shards.value(param, "grad"))
                for key, module, name, param in owned_parameters(self.model)}

    def check_gradients(self, step: int) -> None:
        """Every gradient against the reference's: every step under SGD, the first step's under
        AdamW (the one from identical parameters: tests/helpers/parity.py)."""
        if self.shards is None or step == 0:
            expected = {n: p.grad for n, p in self.reference.named_parameters() if n in self.held}
            assert_tensors_close(self.gradients(), expected, f"step {step} grad")

    def grad_sq_norms(self) -> tuple[float, float]:
        """(the reference's squared gradient norm, the pool's)."""
        pool = self.shards.grad_sq_norm() if self.shards else pool_grad_sq_norm(self.plan, self.groups)
        return grad_sq_norm(self.reference.parameters()), pool

    def update(self, ref_scale: float, scale: float) -> None:
        apply_update(self.ref_optimizer, lr=self.lr, grad_scale=ref_scale)
        apply_update(self.optimizer, lr=self.lr, grad_scale=scale)

    def check_parameters(self) -> None:
        expected = {n: p.detach() for n, p in self.reference.named_parameters() if n in self.held}
        norm = "max" if self.shards is None else "l2"
        assert_tensors_close(full_tensors(self.model), expected, "parameters after training", norm=norm)


def assert_state_split(shards: ShardedOptimizer, replicated: torch.optim.Optimizer, replicas: int) -> None:
    """Each rank holds a `replicas`-th of the replicated optimizer's moments (within the padding
    of each parameter's last piece), and the ranks together hold them once."""
    full = sum(state[m].nbytes for state in replicated.state.values() for m in MOMENTS)
    mine = shards.state_bytes()
    slack = len(replicated.state) * len(MOMENTS) * 4 * (replicas - 1)
    assert abs(mine - full / replicas) <= slack, (mine, full, replicas)
    total = torch.tensor([mine])
    dist.all_reduce(total)
    assert int(total) == full * dist.get_world_size() // replicas, (int(total), full)
