"""Pool checkpoints in `torch.distributed.checkpoint` (DCP) format that load under any layout or
pool size.

A checkpoint directory holds one DCP checkpoint per pool (`<dir>/encoder/`, `<dir>/llm/`), keyed
by the single-device model's names and holding full (unsharded) tensors:

    model.<name>                        parameter or persistent buffer (e.g. the expert bias)
    optimizer.<name>.exp_avg            AdamW moments of parameter <name>
    optimizer.<name>.exp_avg_sq
    optimizer.<name>.step               AdamW's step count of parameter <name> (a scalar)
    optimizer.param_groups.<i>.<key>    hyperparameters of param group i (lr, betas, ...)
    step                                the training step the checkpoint was taken after
    rng.rank<r>.cpu, rng.rank<r>.cuda   generator states of pool rank r

Saving gathers every sharded tensor to its full shape on every rank (a collective) and lets DCP's
planner write each replicated key once, balancing the bytes over the ranks. Restoring reads the
full tensors on every rank and cuts this rank's shard exactly as the pool's `parallelize` cuts
parameters: it runs `parallelize` on single-device copies holding the loaded values, one for the
parameters and one per AdamW moment, so no layout's slicing is written twice.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dyad.parallel.gradients import gather_full, full_state_dict
from dyad.parallel.groups import ProcessGroups

MOMENTS = ("exp_avg", "exp_avg_sq")


def pool_dir(directory: str | Path, pool: str) -> Path:
    """Where `pool`'s DCP checkpoint lies inside the checkpoint directory."""
    return Path(directory) / pool


def save_pool(
    directory: str | Path,
    pool: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: ProcessGroups,
    *,
    step: int,
) -> Path:
    """Write the pool's model, AdamW state, step and this rank's RNG states. Collective over the
    pool's default process group; returns the pool's checkpoint path."""
    state = full_pool_state(model, optimizer, groups)
    state.update(_rng_states(dist.get_rank(), _device(model)))
    state["step"] = step
    path = pool_dir(directory, pool)
    dcp.save(state, checkpoint_id=path)
    return path


def full_pool_state(model: nn.Module, optimizer: torch.optim.Optimizer, groups: ProcessGroups) -> dict:
    """The model's and AdamW's state under the checkpoint's keys, at full shapes, the same on
    every rank. Collective."""
    persistent = model.state_dict().keys()  # the expert counts, zero between steps, are not kept
    state = {f"model.{k}": v for k, v in full_state_dict(model, groups).items() if k in persistent}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            key = f"{module_name}.{name}" if module_name else name
            # A parameter AdamW has not stepped yet: zero moments at step 0 is the state its
            # first step creates, so saving them restores to the same arithmetic.
            saved = optimizer.state.get(param, {})
            for moment in MOMENTS:
                value = saved.get(moment, torch.zeros_like(param)).detach()
                state[f"optimizer.{key}.{moment}"] = gather_full(module, name, value, groups)
            state[f"optimizer.{key}.step"] = saved.get("step", torch.zeros(())).detach()
    state.update(_hyperparameters(optimizer))
    return state


def restore_pool(
    directory: str | Path,
    pool: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    single_device: nn.Module,
    parallelize: Callable[[nn.Module], object],
) -> int:
    """Load the pool's checkpoint into the live `model` and `optimizer`, whatever layout wrote it.

    `single_device`: an unsharded model of the pool's architecture on this rank's device (its
    values are not used); `parallelize(module)` shards a model in place for this rank as the live
    one was. Collective over the pool's default process group. Zeroes the gradients, restores
    this rank's RNG states when the checkpoint holds them, and returns the saved step."""
    path = pool_dir(directory, pool)
    # Full-shape holders the load fills: the parameters (and buffers), each AdamW moment.
    params, *moments = (copy.deepcopy(single_device) for _ in range(1 + len(MOMENTS)))
    steps = {name: torch.zeros(()) for name, _ in single_device.named_parameters()}
    state = {f"model.{k}": v for k, v in params.state_dict().items()}
    for moment, holder in zip(MOMENTS, moments):
        state.update({f"optimizer.{n}.{moment}": p.detach() for n, p in holder.named_parameters()})
    state.update({f"optimizer.{name}.step": t for name, t in steps.items()})
    hyperparameters = _hyperparameters(optimizer)
    state.update(hyperparameters)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    rng = {k: v for k, v in _rng_states(dist.get_rank(), _device(model)).items() if k in stored}
    state.update(rng)
    state["step"] = 0
    dcp.load(state, checkpoint_id=path)

    for holder in (params, *moments):
        parallelize(holder)  # now each holds this rank's shard of the loaded tensors
    model.load_state_dict(params.state_dict())
    local_moments = [dict(holder.named_parameters()) for holder in moments]
    for name, param in model.named_parameters():
        optimizer.state[param] = {
            "step": steps[name].clone(),  # one tensor per parameter: AdamW increments it in place
            **{moment: local[name].detach() for moment, local in zip(MOMENTS, local_moments)},
        }
    for index, group in enumerate(optimizer.param_groups):
        prefix = f"optimizer.param_groups.{index}."
        group.update({k.removeprefix(prefix): state[k] for k in hyperparameters if k.startswith(prefix)})
    optimizer.zero_grad(set_to_none=True)
    _set_rng_states({k: state[k] for k in rng}, dist.get_rank(), _device(model))
    return int(state["step"])


def _hyperparameters(optimizer: torch.optim.Optimizer) -> dict:
    return {
        f"optimizer.param_groups.{index}.{k}": v
        for index, group in enumerate(optimizer.param_groups)
        for k, v in group.items()
        if k != "params"
    }


def load_pool_state(directory: str | Path, pool: str) -> dict[str, torch.Tensor]:
    """The pool's full single-device model state dict (CPU), read in this process alone."""
    path = pool_dir(directory, pool)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns on every single-process load, even when asked for one
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return {key.removeprefix("model."): value for key, value in state.items()}


def saved_ranks(directory: str | Path, pool: str) -> list[int]:
    """The pool ranks that wrote the checkpoint (each saved its RNG states), ascending."""
    stored = dcp.FileSystemReader(pool_dir(directory, pool)).read_metadata().state_dict_metadata
    return sorted(int(key.split(".")[1].removeprefix("rank")) for key in stored if _is_cpu_rng_key(key))


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _rng_key(rank: int, generator: str) -> str:
    return f"rng.rank{rank}.{generator}"


def _is_cpu_rng_key(key: str) -> bool:
    return key.startswith("rng.rank") and key.endswith(".cpu")


def _rng_states(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    states = {_rng_key(rank, "cpu"): torch.get_rng_state()}
    if device.type == "cuda":
        states[_rng_key(rank, "cuda")] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(states: dict[str, torch.Tensor], rank: int, device: torch.device) -> None:
    if _rng_key(rank, "cpu") in states:
        torch.set_rng_state(states[_rng_key(rank, "cpu")])
    if _rng_key(rank, "cuda") in states:
        torch.cuda.set_rng_state(states[_rng_key(rank, "cuda")], device)
