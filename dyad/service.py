"""What every pool's worker shares: the pool's process groups, the parallelized model and its
optimizer, the gradient reduction, the update and the save.

Each pool type's service (`dyad.pools`: e.g. `encoder_service.worker`, `llm_service.worker`)
subclasses `PoolService` with its single-device model, how to parallelize it, and its step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod

import torch
from torch import nn

from dyad.checkpoint import pool_dir, restore_pool, save_pool
from dyad.compile import compile_blocks, log_recompiles
from dyad.config import RunConfig
from dyad.data import make_dataset
from dyad.init import init_parameters
from dyad.kernels.boundary_pack import RowSegments
from dyad.optim import apply_update, build_optimizer, skip_update
from dyad.parallel.gradients import GradientPlan, pool_grad_sq_norm
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.overlap import GradientReduction
from dyad.parallel.sharded_optimizer import ShardedOptimizer
from dyad.pools import pool_type
from dyad.recompute import recompute_blocks
from dyad.transport import Transport
from dyad.wire import pb
from dyad.working_weights import WorkingWeights, trained_parameters

log = logging.getLogger(__name__)

def build_model(
    config: RunConfig, pool: str, device: str | torch.device | None = None, *, initialize: bool = True,
    pretrained: bool = True,
) -> nn.Module:
    """The pool's single-device model with its layout-independent initial weights, built on
    `device` (default the run's): no full copy of it passes through host memory; then the
    pretrained weights its config names, unless `pretrained` is off (a pool's rank reads its own
    pieces of them once `parallelize` has cut the model). Without `initialize` its parameters
    keep the values the modules were built with: for a model a checkpoint is restored into,
    which overwrites every one (drawing the initial weights of a model of billions of parameters
    takes seconds of CPU)."""
    kind = pool_type(pool)
    with torch.device(device or config.train.device):
        model = kind.service_class().single_device_model(config)
    if initialize:  # each pool's weights come from its own stream of the run seed
        init_parameters(model, config.seed * 10 + kind.seed_offset)
        if pretrained:
            kind.service_class().load_pretrained(model, config)
    return model


def compute_context(config: RunConfig):
    """Autocast for bfloat16 runs; float32 runs compute in float32."""
    if config.train.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(config.train.device, dtype=torch.bfloat16)


def boundary_dtype(config: RunConfig) -> torch.dtype:
    return getattr(torch, config.train.dtype)


def transfer_segments(transfer: pb.Transfer, device) -> RowSegments:
    """The transfer's row segments, ready to pack and unpack on `device`."""
    return RowSegments([(s.src_row, s.dst_row, s.length) for s in transfer.segments], device=device)


def pool_device(config: RunConfig, pool: str, rank: int) -> torch.device:
    if config.train.device == "cuda":
        return torch.device("cuda", config.parallel.local_gpu(pool, rank, torch.cuda.device_count()))
    return torch.device("cpu")


class PoolService(ABC):
    """One rank of a pool. `torch.distributed` is initialised for the pool before this is built."""

    pool = ""

    def __init__(self, config: RunConfig, transport: Transport, rank: int, run_id: str, *, initialize: bool = True):
        """`initialize`: draw the model's initial weights; without, the first setup must restore a
        checkpoint (the router says so when the worker registers: `RegisterReply.restores`)."""
        self.config = config
        self.transport = transport
        self.rank = rank
        self.run_id = run_id
        self.device = pool_device(config, self.pool, rank)
        self.dataset = make_dataset(config.data)
        self.layout = getattr(config.parallel, self.pool)
        self.groups = ProcessGroups.build(self.layout)
        self.model = build_model(config, self.pool, self.device, initialize=initialize, pretrained=False)
        self.awaits_restore = not initialize
        self.gradient_plan = self.parallelize(self.model, self.groups)
        if initialize:
            self.load_pretrained(self.model, config)  # this rank's pieces only
        self.freeze(self.model, config)  # after parallelize: tensor parallelism makes new parameters
        self.gradient_plan = self.gradient_plan.trained()
        self.working_weights = WorkingWeights(self.model) if config.train.working_weights else None
        if self.pool in config.train.recompute:
            recompute_blocks(self.model)
        if config.train.compile:
            compile_blocks(self.model, config.train.compile_backend)
            log_recompiles()
        self._build_optimizer(config.train)
        self.reduction = GradientReduction(
            self.gradient_plan, self.groups, overlap=config.train.overlap_grad_reduce, into=self.shards
        )
        self.peers: dict[tuple[int, int], str] = {}
        self.lr = config.train.lr
        self.generation = 0
        self.run_secret = b""  # the run's data-plane secret, from the router's Register reply

    def _build_optimizer(self, train) -> None:
        """`optimizer`, what steps (the parameters, or the sharded optimizer's pieces of them);
        `optimizer_state`, what checkpoints read and write; `shards`, the sharded optimizer,
        where train.shard_optimizer finds replicas to shard over."""
        self.shards = None
        if train.shard_optimizer and has_replicas(self.gradient_plan, self.groups):
            self.shards = ShardedOptimizer(self.gradient_plan, self.groups, train)
            self.optimizer, self.optimizer_state = self.shards.adamw, self.shards
            over = [f"{name} {self.groups.size(name)}" for name, params in self.gradient_plan.reduce_over.items() if params]
            log.info("optimizer state sharded over each parameter's replicas (%s): %.1f MB on this rank",
                     ", ".join(over), self.shards.state_bytes() / 1e6)
            return
        self.optimizer = self.optimizer_state = build_optimizer(trained_parameters(self.model), train)
        if self.working_weights:
            self.working_weights.refresh_after_each_step(self.optimizer)

    @staticmethod
    @abstractmethod
    def single_device_model(config: RunConfig) -> nn.Module:
        """The pool's model for one device, built on the current default device; its weights
        are drawn afterwards (`build_model`)."""

    @staticmethod
    def load_pretrained(model: nn.Module, config: RunConfig) -> None:
        """Overwrite the drawn initial weights with pretrained ones where the pool's config names
        some (none here): the single-device model's, or a parallelized one's pieces of them, each
        rank reading only its own (`dyad.slices.load_pieces`)."""

    @staticmethod
    def freeze(model: nn.Module, config: RunConfig) -> None:
        """Hold the parts of `model` that train.freeze names (`requires_grad` off: no gradient,
        no update); none here."""

    @abstractmethod
    def parallelize(self, model: nn.Module, groups: ProcessGroups):
        """Shard the pool's single-device model for this rank; returns its GradientPlan."""

    @property
    def message_space(self) -> str:
        """What boundary message tags are scoped to: this run's current generation, so a
        message of an aborted generation can never match a receive of the next."""
        return f"{self.run_id}/{self.generation}"

    def setup(self, command: pb.SetupCommand) -> pb.SetupResult:
        """Join a generation: its peers (the only ones the data plane accepts), and the
        committed checkpoint to continue from."""
        started = time.perf_counter()
        self.generation = command.generation
        self.peers = {(p.worker.pool, p.worker.rank): p.data_address for p in command.peers}
        self.transport.authorize(
            self.run_secret,
            {p.data_address for p in command.peers if p.worker.pool != pool_type(self.pool).wire_id},
        )
        restored = -1
        if self.awaits_restore and not command.restore_path:
            raise RuntimeError(
                f"generation {command.generation}: this {self.pool} worker was built without initial weights "
                "because the router said its setup would restore a checkpoint, and the setup names none"
            )
        if command.restore_path:
            log.info("generation %d: restoring %s", command.generation, command.restore_path)
            restored = self.restore(command.restore_path)
            self.awaits_restore = False
        log.info("generation %d: set up in %.1fs (restored step %d)", command.generation,
                 time.perf_counter() - started, restored)
        return pb.SetupResult(
            generation=command.generation,
            restored_step=restored,
            seconds=time.perf_counter() - started,
        )

    def peak_memory_gb(self) -> float:
        """What StepResult.peak_memory_gb reports: the most memory PyTorch's allocator has
        reserved on this rank's GPU since the process started; 0 on CPUs."""
        if self.device.type != "cuda":
            return 0.0
        return torch.cuda.max_memory_reserved(self.device) / 1e9

    def finish_backward(self) -> float:
        """Finish reducing this step's gradients in the pool's layout (what the last backward,
        armed by `self.reduction.arm()`, has not sent yet); the pool's squared gradient norm
        as this rank reports it (rank 0 reports the pool's, the others 0)."""
        self.reduction.finish()
        if self.shards:
            sq_norm = self.shards.grad_sq_norm(self.device)
        else:
            sq_norm = pool_grad_sq_norm(self.gradient_plan, self.groups, self.device)
        return sq_norm if self.rank == 0 else 0.0

    def evaluate(self, command: pb.EvalCommand) -> pb.EvalResult:
        """Forward passes over the held-out batches of `command`, the weights unchanged. A pool
        that adds nothing to the held-out measures (none here) reports nothing."""
        return pb.EvalResult(step=command.step)

    def apply(self, command: pb.ApplyCommand) -> pb.ApplyResult:
        """The step's update, or none (`command.skip`: the router saw a non-finite loss or
        gradient norm): the gradients are dropped either way."""
        if command.skip:
            skip_update(self.optimizer)
        else:
            apply_update(self.optimizer, lr=self.lr, grad_scale=command.grad_scale)
        return pb.ApplyResult(step=command.step)

    def save(self, command: pb.SaveCommand) -> pb.SaveResult:
        """The pool's checkpoint at `<command.path>/<pool>/`, written by every rank together in
        a form that loads under any layout or pool size (`dyad.checkpoint`)."""
        from torch.distributed.checkpoint import CheckpointException  # imported by save_pool anyway

        try:
            path = save_pool(
                command.path, self.pool, self.model, self.optimizer_state, step=command.step,
                sync_files=command.sync_files, holders=self.groups.group(self.layout.PARAMETER_GROUP),
            )
        except CheckpointException as error:  # a BaseException: the worker reports Exceptions
            raise _not_written(error, pool_dir(command.path, self.pool)) from error
        return pb.SaveResult(step=command.step, path=str(path))

    def restore(self, path: str) -> int:
        """Load `<path>/<pool>/` into the live model and optimizer, whatever layout or pool size
        wrote it; returns the saved step. Collective over the pool."""
        step = restore_pool(path, self.pool, self.model, self.optimizer_state,
                            holders=self.groups.group(self.layout.PARAMETER_GROUP))
        if self.working_weights and not self.shards:  # the sharded optimizer loads them itself
            self.working_weights.refresh()
        return step

    def close(self) -> None:
        pass


def has_replicas(plan: GradientPlan, groups: ProcessGroups) -> bool:
    """Whether some parameter the plan trains is held whole by more than one rank: what
    `train.shard_optimizer` shards."""
    return any(params and groups.size(name) > 1 for name, params in plan.reduce_over.items())


def _not_written(error, path) -> Exception:
    """DCP's CheckpointException (every rank's failure: rank -> (exception, traceback)) as one
    Exception that names the checkpoint's directory: the first failure's OSError, errno kept (a
    full disk reads as one, `dyad.app.worker.would_repeat`), or a RuntimeError quoting it."""
    cause, _ = next(iter(error.failures.values()))
    if isinstance(cause, OSError) and cause.errno is not None:
        return OSError(cause.errno, cause.strerror, str(path))
    return RuntimeError(f"could not write the checkpoint {path}: {cause!r}")
