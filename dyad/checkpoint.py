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

Saving gathers one sharded tensor at a time to its full shape (a collective) and keeps it, in
host memory, only on the rank chosen to write it (the ranks take turns by bytes), so a rank
holds about 1/world of the full state and the GPUs one full tensor beyond their own state.
"The ranks" are those that hold the same parameters, each its own pieces (`holders`): the whole
pool, or one pipeline stage of the LLM's, whose stages hold disjoint parameters; each tensor is
then written once, by a rank of the stage that holds it.
Restoring reads the full tensors in batches of bounded size, each tensor by one rank into its
host memory (the ranks take turns by bytes, as in saving; a rank reads its tensors of a batch
with several threads), broadcasts it to the other ranks, and
copies each rank's piece into its live model and AdamW state, cut by `local_part`: the inverse of
the gather, written beside it and used by the parallel modules when they shard themselves, so
no layout's slicing is written twice.

The optimizer's state is read and written at each parameter's shape on the rank
(`OptimizerState`): a sharded optimizer (`dyad.parallel.sharded_optimizer`) gathers its pieces
to that shape before the tensor-parallel gather, and takes its own piece of what a restore
gives it, so the format is the same whether and however the state was sharded.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from dyad.byte_runs import byte_runs
from dyad.optim import set_step_count
from dyad.parallel.gradients import gather_full, local_part, owned_parameters

MOMENTS = ("exp_avg", "exp_avg_sq")
RESTORE_BATCH_BYTES = 1 << 30  # full tensors read into host memory at a time, over all ranks
# Threads each rank serializes and writes its files with: eight save a rank's part markedly
# sooner than DCP's one (bench/checkpoint_io.py).
WRITER_THREADS = 8
# Threads each rank reads its tensors of a restore's batch with, each thread one DCP load of its
# share of the bytes: DCP's FileSystemReader reads and deserializes one stored tensor after the
# other, and that, not the disk, bounded a restore from the page cache (bench/checkpoint_io.py).
READER_THREADS = 8


def _dcp():
    """torch.distributed.checkpoint, imported where a checkpoint is read or written: importing it
    pulls in DTensor and costs about a second, which every process importing this module paid."""
    import torch.distributed.checkpoint as dcp

    return dcp


class OptimizerState(Protocol):
    """What a checkpoint reads and writes of a pool's optimizer, at each parameter's shape on this
    rank: a torch optimizer's whole state (`_Replicated`), or the sharded optimizer's
    (`dyad.parallel.sharded_optimizer.ShardedOptimizer`), which gathers and cuts its pieces."""

    param_groups: list[dict]

    def value(self, param: nn.Parameter, what: str) -> torch.Tensor:
        """`param`'s values ("param") or an AdamW moment (zeros where it has none yet).
        Collective over the ranks that share the parameter's state."""

    def load(self, param: nn.Parameter, what: str, full: torch.Tensor) -> None:
        """The inverse of `value`: `full`, as `value` returns it, into place."""

    def step_count(self, param: nn.Parameter) -> torch.Tensor: ...

    def load_step_count(self, param: nn.Parameter, step: torch.Tensor) -> None: ...

    def zero_grad(self) -> None: ...


class _Replicated:
    """A torch optimizer over the parameters themselves, its whole state on every rank."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def value(self, param, what):
        if what == "param":
            return param.detach()
        # A parameter AdamW has not stepped yet: zero moments at step 0 is the state its first
        # step creates, so saving them restores to the same arithmetic.
        return self.optimizer.state.get(param, {}).get(what, torch.zeros_like(param)).detach()

    @torch.no_grad()
    def load(self, param, what, full):
        if what == "param":
            param.copy_(full)
            return
        state = self.optimizer.state[param]
        state.setdefault(what, torch.zeros_like(param, memory_format=torch.preserve_format)).copy_(full)

    def step_count(self, param):
        return self.optimizer.state.get(param, {}).get("step", torch.zeros(())).detach()

    def load_step_count(self, param, step):
        set_step_count(self.optimizer, param, step)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


def optimizer_state(optimizer: torch.optim.Optimizer | OptimizerState) -> OptimizerState:
    """What the checkpoint reads of `optimizer`: a torch optimizer's state, or the state given."""
    return _Replicated(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else optimizer


def pool_dir(directory: str | Path, pool: str) -> Path:
    """Where `pool`'s DCP checkpoint lies inside the checkpoint directory."""
    return Path(directory) / pool


def save_pool(
    directory: str | Path,
    pool: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerState,
    *,
    step: int,
    writer_threads: int = WRITER_THREADS,
    sync_files: bool = True,
    holders: dist.ProcessGroup | None = None,
) -> Path:
    """Write the pool's model, AdamW state, step and this rank's RNG states, each rank's files with
    `writer_threads` threads; `sync_files`: each file is synced to stable storage before this
    returns (otherwise it is written to the page cache, and the router syncs it before it
    commits the checkpoint: `dyad.router.checkpoints.commit`). `holders`: the ranks that hold the
    same parameters as this one (default the whole pool), which share out their writing.
    Collective over the pool's default process group; returns the pool's checkpoint path."""
    dcp = _dcp()
    state = _owned_full_state(model, optimizer, dist.get_rank(holders), dist.get_world_size(holders))
    state.update(_rng_states(dist.get_rank(), _device(model)))
    state["step"] = step
    path = pool_dir(directory, pool)
    writer = dcp.FileSystemWriter(path, thread_count=writer_threads, sync_files=sync_files)
    dcp.save(state, storage_writer=writer)
    return path


def full_pool_state(model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerState) -> dict:
    """The model's and AdamW's state under the checkpoint's keys, at full shapes, the same on
    every rank. Collective."""
    return dict(_full_entries(model, optimizer)) | _hyperparameters(optimizer_state(optimizer))


def _owned_full_state(model, optimizer: torch.optim.Optimizer | OptimizerState, rank: int, world: int) -> dict:
    """The full tensors this rank writes, in host memory: every tensor goes to the rank with the
    fewest bytes so far (the same choice on every rank). Collective."""
    optimizer = optimizer_state(optimizer)
    turns = _TurnsByBytes(world)
    owned = {}
    for key, full in _full_entries(model, optimizer):
        if turns.owner(full.numel() * full.element_size()) == rank:
            owned[key] = full.detach().cpu()
    owned.update(_hyperparameters(optimizer))  # small and the same everywhere: written once
    return owned


def _full_entries(model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerState):
    """(key, full tensor) for every tensor of the checkpoint, in one order on every rank; each
    full tensor is gathered when the iteration reaches it (a collective)."""
    optimizer = optimizer_state(optimizer)
    persistent = model.state_dict().keys()  # the expert counts, zero between steps, are not kept
    for key, module, name, param in owned_parameters(model):
        yield f"model.{key}", gather_full(module, name, optimizer.value(param, "param"))
    for key, buffer in model.named_buffers():
        if key in persistent:
            yield f"model.{key}", buffer.detach()
    for key, module, name, param in owned_parameters(model):
        for moment in MOMENTS:
            yield f"optimizer.{key}.{moment}", gather_full(module, name, optimizer.value(param, moment))
        yield f"optimizer.{key}.step", optimizer.step_count(param)


def restore_pool(
    directory: str | Path,
    pool: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerState,
    *,
    batch_bytes: int = RESTORE_BATCH_BYTES,
    reader_threads: int = READER_THREADS,
    holders: dist.ProcessGroup | None = None,
) -> int:
    """Load the pool's checkpoint into the live `model` and `optimizer`, whatever layout wrote it.

    Each full tensor is read by one rank (the ranks take turns by bytes, as in saving), at most
    `batch_bytes` a rank at a time (or one tensor, when it is larger), with `reader_threads`
    threads, and broadcast to the others, so the pool reads the checkpoint once; each rank copies
    its piece into place. `holders`: as in `save_pool`, the ranks that share out the reading.
    Collective over the pool's default process group. Zeroes the gradients, restores this rank's
    RNG states when the checkpoint holds them, and returns the saved step."""
    dcp = _dcp()
    optimizer = optimizer_state(optimizer)
    path = pool_dir(directory, pool)
    with _reading(path):
        metadata = dcp.FileSystemReader(path).read_metadata()
    stored = metadata.state_dict_metadata
    targets = _restore_targets(model, optimizer)
    _check_holds(stored, targets, path)
    turns = _TurnsByBytes(dist.get_world_size(holders))
    staging = _Staging(_device(model))
    with _ThreadedReader(path, metadata, reader_threads) as reader:
        for batch in _batches(list(targets), stored, batch_bytes):
            for key, full in _read_once_for_all(batch, stored, turns, staging, reader, holders):
                module, name, load = targets[key]
                load(local_part(module, name, full))
    staging.release()
    small = _hyperparameters(optimizer) | {f"optimizer.{key}.step": torch.zeros(()) for key, *_ in owned_parameters(model)}
    small.update({k: v for k, v in _rng_states(dist.get_rank(), _device(model)).items() if k in stored})
    small["step"] = 0
    with _reading(path):
        dcp.load(small, checkpoint_id=path)
    for key, _, _, param in owned_parameters(model):
        optimizer.load_step_count(param, small[f"optimizer.{key}.step"])
    for index, group in enumerate(optimizer.param_groups):
        prefix = f"optimizer.param_groups.{index}."
        group.update({k.removeprefix(prefix): small[k] for k in small if k.startswith(prefix)})
    optimizer.zero_grad()
    _set_rng_states({k: v for k, v in small.items() if k.startswith("rng.")}, dist.get_rank(), _device(model))
    return int(small["step"])


class UnreadableCheckpoint(RuntimeError):
    """A pool's checkpoint files could not be read (missing, truncated, or damaged)."""


@contextlib.contextmanager
def _reading(path: Path):
    """Names the checkpoint in a failure to read it: DCP's errors name no file (a truncated one
    fails with "PytorchStreamReader failed reading zip archive"), and its CheckpointException,
    whose message is every failed rank's traceback, is a BaseException, which a worker's report
    of its failure (`except Exception`) let through: the worker died saying nothing."""
    try:
        yield
    except (Exception, _dcp().api.CheckpointException) as error:
        lines = str(error).strip().splitlines()
        last = lines[-1] if lines else ""
        reason = last if isinstance(error, _dcp().api.CheckpointException) else f"{type(error).__name__}: {last}"
        raise UnreadableCheckpoint(f"cannot read the checkpoint at {path}: {reason}") from error


def _check_holds(stored: dict, targets: dict, path: Path) -> None:
    absent = [key for key in targets if key not in stored]
    if absent:
        raise ValueError(
            f"checkpoint {path} has no {', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''} "
            f"({len(absent)} of the model's {len(targets)} tensors): it was written for another model"
        )


def _restore_targets(model: nn.Module, optimizer: OptimizerState) -> dict:
    """checkpoint key -> (module, attribute name, what puts this rank's piece of it in place)."""
    persistent = model.state_dict().keys()
    targets = {}
    for key, module, name, param in owned_parameters(model):
        targets[f"model.{key}"] = (module, name, functools.partial(optimizer.load, param, "param"))
    for key, buffer in model.named_buffers():
        if key in persistent:
            targets[f"model.{key}"] = (None, key, buffer.copy_)
    for key, module, name, param in owned_parameters(model):
        for moment in MOMENTS:
            targets[f"optimizer.{key}.{moment}"] = (module, name, functools.partial(optimizer.load, param, moment))
    return targets


def _read_once_for_all(keys: list[str], stored: dict, turns: _TurnsByBytes, staging: _Staging, reader, holders):
    """(key, full tensor on the staging's device) for each of `keys`, in order: each read from the
    checkpoint into `staging` by the rank of `holders` whose turn it is and broadcast from it to
    the others. Collective over `holders`."""
    owners = {key: turns.owner(_stored_bytes(stored[key])) for key in keys}
    rank = dist.get_rank(holders)
    mine = staging.holders({key: stored[key] for key in keys if owners[key] == rank})
    with _reading(reader.path):
        reader.load(mine)
    for key in keys:
        if owners[key] == rank:
            full = mine.pop(key).to(staging.device, non_blocking=True)
        else:
            full = _holder(stored[key], staging.device)
        dist.broadcast(full, group=holders, group_src=owners[key])
        yield key, full


class _ThreadedReader:
    """Reads stored tensors into the tensors given for them, one DCP load per thread, each of
    about an equal share of the bytes (a tensor is read whole, by one thread). Each load is this
    rank's alone (`no_dist`: which rank reads what is decided by `_TurnsByBytes`), with the
    checkpoint's metadata read once for all of them."""

    def __init__(self, path: Path, metadata, threads: int):
        if threads < 1:
            raise ValueError(f"reader_threads must be at least 1, got {threads}")
        self.path, self.metadata, self.threads = path, metadata, threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dyad-restore") if threads > 1 else None

    def load(self, holders: dict[str, torch.Tensor]) -> None:
        shares = [share for share in self._shares(holders) if share]
        # DCP warns on every load of one process's own, even when asked for one. The filter is the
        # process's: set here, around the threads' loads, while this thread waits for them.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if self._pool is None or len(shares) < 2:
                for share in shares:
                    self._load_share(share)
                return
            for done in [self._pool.submit(self._load_share, share) for share in shares]:
                done.result()  # re-raises a thread's error here

    def _shares(self, holders: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        turns, shares = _TurnsByBytes(self.threads), [{} for _ in range(self.threads)]
        for key in sorted(holders, key=lambda k: -holders[k].nbytes):  # largest first: even shares
            shares[turns.owner(holders[key].nbytes)][key] = holders[key]
        return shares

    def _load_share(self, share: dict[str, torch.Tensor]) -> None:
        _dcp().load(share, storage_reader=_known_metadata_reader()(self.path, self.metadata), no_dist=True)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        if self._pool is not None:
            self._pool.shutdown()


@functools.cache
def _known_metadata_reader() -> type:
    """DCP's FileSystemReader, made with the checkpoint's metadata already read, which it hands out
    instead of reading and unpickling the file again for every load (a class made once, when DCP
    is first needed: see `_dcp`)."""

    class KnownMetadataReader(_dcp().FileSystemReader):
        def __init__(self, path: Path, metadata):
            super().__init__(path)
            self._metadata = metadata

        def read_metadata(self, *args, **kwargs):
            return self._metadata

    return KnownMetadataReader


class _Staging:
    """One host buffer that every batch of a restore is read into, cut into its tensors: page-locked
    when the model is on a GPU, so that the copies to it are fast and need not be waited for,
    and reused rather than fresh ordinary memory for each tensor (docs/performance.md, "Four and
    eight GPUs (issue 8)", checkpoint I/O). Grown to the largest batch; a batch waits for the last
    one's copies before it overwrites them."""

    _ALIGN = 64  # bytes: every tensor's offset in the buffer

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def holders(self, metas: dict) -> dict[str, torch.Tensor]:
        offsets, end = {}, 0
        for key, meta in metas.items():
            offsets[key] = end
            end += -(-_stored_bytes(meta) // self._ALIGN) * self._ALIGN
        if self._pinned:
            torch.cuda.current_stream(self.device).synchronize()  # the last batch's copies are done
        if end > self._buffer.numel():
            self._buffer = torch.empty(end, dtype=torch.uint8, pin_memory=self._pinned)
        return {
            key: self._buffer[offsets[key] : offsets[key] + _stored_bytes(meta)]
            .view(meta.properties.dtype)
            .view(meta.size)
            for key, meta in metas.items()
        }

    def release(self) -> None:
        """Hands the buffer back; page-locked memory also leaves torch's cache of it."""
        self._buffer = torch.empty(0, dtype=torch.uint8)
        if self._pinned:
            torch.cuda.current_stream(self.device).synchronize()
            empty_host_cache()


def empty_host_cache() -> None:
    """Hands the page-locked memory torch keeps cached back to the system (torch.accelerator's call
    from torch 2.12, torch._C's before). Needs a GPU."""
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


class _TurnsByBytes:
    """Hands each tensor to the rank that has taken the fewest bytes so far, the same choice on
    every rank given the same sizes in the same order."""

    def __init__(self, world: int):
        self.taken = [0] * world

    def owner(self, nbytes: int) -> int:
        rank = min(range(len(self.taken)), key=self.taken.__getitem__)
        self.taken[rank] += nbytes
        return rank


def _holder(meta, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(meta.size, dtype=meta.properties.dtype, device=device)


def _stored_bytes(meta) -> int:
    return meta.size.numel() * meta.properties.dtype.itemsize


def _batches(keys: list[str], stored: dict, batch_bytes: int):
    """`keys` in order, cut into runs whose stored tensors total at most `batch_bytes`."""
    return byte_runs(keys, lambda key: _stored_bytes(stored[key]), batch_bytes)


def _hyperparameters(optimizer: OptimizerState) -> dict:
    return {
        f"optimizer.param_groups.{index}.{k}": v
        for index, group in enumerate(optimizer.param_groups)
        for k, v in group.items()
        if k != "params"
    }


def load_pool_state(directory: str | Path, pool: str) -> dict[str, torch.Tensor]:
    """The pool's full single-device model state dict (CPU), read in this process alone."""
    dcp = _dcp()
    path = pool_dir(directory, pool)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {
        key: _holder(meta)
        for key, meta in stored.items()
        if key.startswith("model.") and isinstance(meta, dcp.metadata.TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns on every single-process load, even when asked for one
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return {key.removeprefix("model."): value for key, value in state.items()}


def saved_ranks(directory: str | Path, pool: str) -> list[int]:
    """The pool ranks that wrote the checkpoint (each saved its RNG states), ascending."""
    dcp = _dcp()
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
