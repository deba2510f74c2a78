"""Deterministic parameter initialisation, keyed by parameter name.

Each parameter's values depend only on (seed, its name, its full shape): a generator seeded from
(seed, crc32(name)) fills the full tensor on CPU in float32, which is then copied in. So the
order in which modules were built, the device, the dtype and any sharding of the parameter do
not change the values. A sharded parameter (DTensor, e.g. after FSDP2 or tensor parallelism)
receives its own slice of the same full tensor.

Parameters are filled on a few threads (each parameter's values come from its own generator,
so the order does not matter): a model of billions of parameters is mostly normal samples drawn
on CPU, which one thread draws at ~200 M/s.

Rules by name: norm weights (names ending in `norm.weight`, or weights of LayerNorm/RMSNorm/
GroupNorm/BatchNorm modules) are 1, biases are 0, everything else is normal(0, 0.02).
"""

import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

INIT_STD = 0.02
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _norm_weight_names(module: nn.Module) -> set[str]:
    names = set()
    for module_name, sub in module.named_modules():
        if isinstance(sub, _NORM_TYPES) and getattr(sub, "weight", None) is not None:
            names.add(f"{module_name}.weight" if module_name else "weight")
    return names


def initial_value(name: str, shape: torch.Size, seed: int, is_norm_weight: bool) -> torch.Tensor:
    """The full float32 CPU tensor that parameter `name` starts from."""
    if is_norm_weight:
        return torch.ones(shape)
    if name == "bias" or name.endswith(".bias"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, INIT_STD, generator=generator)


def _is_dtensor(param: torch.Tensor) -> bool:
    # Not imported here (it costs about a second): no DTensor exists before its module is loaded.
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    return dtensor_module is not None and isinstance(param, dtensor_module.DTensor)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    if _is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: each rank cuts its own shard from its identical copy, no collectives.
        mesh = param.device_mesh
        shard = distribute_tensor(full.to(mesh.device_type), mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def init_threads() -> int:
    """Threads that draw initial values: a few, not more than torch's CPU threads here (a local
    worker gets its share of the machine's CPUs, `dyad.cpus.worker_threads`)."""
    return max(1, min(8, torch.get_num_threads()))


def init_parameters(module: nn.Module, seed: int, threads: int | None = None) -> None:
    """Fill every parameter of `module` from (seed, name), independent of build order, sharding
    and the number of `threads` drawing values (default `init_threads()`)."""
    norm_weights = _norm_weight_names(module)

    @torch.no_grad()  # grad mode is per thread: set in the one that copies
    def fill(named: tuple[str, torch.Tensor]) -> None:
        name, param = named
        is_norm_weight = name in norm_weights or name.endswith("norm.weight")
        _copy_full_into(param, initial_value(name, param.shape, seed, is_norm_weight))

    with ThreadPoolExecutor(max_workers=threads or init_threads()) as pool:
        list(pool.map(fill, module.named_parameters()))  # waits, and re-raises a thread's error
