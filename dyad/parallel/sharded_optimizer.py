"""The optimizer sharded over each parameter's replicas (ZeRO-1, as Megatron-LM's distributed
optimizer). The N ranks a parameter's gradient is summed over (`GradientPlan.reduce_over`: dense
parameters over dp×cp, expert weights over edp, the encoder's over dp) each hold the whole
parameter; here each keeps the float32 master values and AdamW moments of only its own part of
it: on each rank 1/N of the replicated optimizer's state.

Geometry, per group of N ranks, this rank its i-th. The group's parameters go in the buckets the
gradient reduction sends (`gradient_buckets`, reverse registration order). A parameter's
flattened values are cut in N chunks of `chunk = ceil(numel / N)` (the last shorter, or empty);
rank i owns chunk i of every parameter: its *piece*. A bucket's pieces lie side by side in a
rank's shard, each padded to its chunk: the bucket is N rows of C values (C, the sum of its
parameters' chunks), row i rank i's shard.

A step:
1. Reduce-scatter (`ShardBucket.send`): each bucket's gradients are copied into its N x C rows
   and reduce-scattered; rank i receives its pieces' summed gradients and the parameters'
   gradients are dropped. The buckets go from the hooks that send the all-reduce's
   (`dyad.parallel.overlap.GradientReduction` with `into=` this optimizer): overlapped with the
   step's last backward pass in the same way, the same bounded copies in flight.
2. Norm (`grad_sq_norm`): each rank the squares of its pieces of the parameters its group counts
   (`GradientPlan.counted`), summed over the pool: each distinct value counted once.
3. `adamw` (one torch AdamW over every piece, each parameter's weight decay by its shape, as
   `build_optimizer` decides it) steps the pieces; its step hook then
4. all-gathers (`gather`) each bucket's updated rows into the parameters the model computes with:
   the parameters themselves, or their bf16 working weights. The buckets go one after the other
   with two in flight, each copied out while the next is gathered; after the update, not
   overlapped with the next step's forward pass.

Masters. A float32 parameter the model computes with is its own master: full on every rank,
its piece a view of it (updated in place; the other ranks' pieces arrive by the all-gather). A
parameter behind a bf16 working weight (`dyad/working_weights.py`) has its float32 values only
in its pieces: its master keeps its shape, to accumulate the working weight's gradient in
float32, and no values (`dyad.kernels.master_weights.release`).

A group of one rank (no replica) takes the same path without collectives: its pieces are whole
parameters, their gradients the parameters' own.

Checkpoints (`dyad.checkpoint`) read and write the state at each parameter's shape on this rank
(`value`, `load`): a layout-independent checkpoint loads under any N.

Legend: N ranks of the group, C values of a bucket's shard (padded pieces side by side).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from dyad.kernels.fp8 import forget_quantized
from dyad.kernels.master_weights import WORKING_ATTRIBUTE, release
from dyad.optim import adamw, decays, set_step_count, sq_norm
from dyad.parallel.buckets import BUCKET_BYTES
from dyad.parallel.collectives import all_gather_single, reduce_scatter_single
from dyad.parallel.gradients import GradientPlan, gradient_buckets, grads_or_zeros
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.overlap import Sent

MOMENTS = ("exp_avg", "exp_avg_sq")
GATHERS_IN_FLIGHT = 2  # buckets' all-gathers started before the oldest is copied out


class _Piece:
    """This rank's chunk of one parameter: `values`, what AdamW steps (a view of the parameter, or
    its own float32 tensor where the parameter is a working weight's master)."""

    def __init__(self, param: nn.Parameter, size: int, index: int, offset: int):
        self.param = param
        self.working = getattr(param, WORKING_ATTRIBUTE, None)
        self.target = param if self.working is None else self.working  # what the model computes with
        self.numel, self.shape = param.numel(), param.shape
        self.chunk = -(-self.numel // size)
        self.offset = offset  # in the bucket's shard
        self.start = min(index * self.chunk, self.numel)
        self.length = min(self.chunk, self.numel - self.start)
        flat = param.detach().view(-1)[self.start : self.start + self.length]
        self.values = flat if self.working is None else flat.clone()


class ShardBucket:
    """One bucket of a group's parameters: its pieces on this rank, its reduce-scatter and its
    all-gather (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, size: int, index: int):
        self.params, self.group, self.size, self.index = params, group, size, index
        self.pieces, offset = [], 0
        for param in params:
            self.pieces.append(_Piece(param, size, index, offset))
            offset += self.pieces[-1].chunk
        self.columns = offset  # C

    def send(self) -> Sent:
        """Start summing the bucket's gradients into this rank's pieces; the parameters' own
        gradients are dropped."""
        if self.size == 1:  # the pieces are the parameters: their gradients, as they are
            for piece in self.pieces:
                grad, piece.param.grad = piece.param.grad, None
                piece.values.grad = None if grad is None else grad.reshape(-1)
            return Sent(None, None)
        rows_NC = torch.zeros(self.size, self.columns, dtype=self.params[0].dtype, device=self.params[0].device)
        for piece, grad in zip(self.pieces, grads_or_zeros(self.params)):
            _into_rows(grad.reshape(-1), rows_NC, piece)
            piece.param.grad = None
        shard_C = rows_NC.new_empty(self.columns)
        work = reduce_scatter_single(shard_C, rows_NC.view(-1), group=self.group, async_op=True)
        return Sent(work, rows_NC, lambda: self._take_gradients(shard_C))

    def _take_gradients(self, shard_C: torch.Tensor) -> None:
        for piece in self.pieces:
            piece.values.grad = shard_C[piece.offset : piece.offset + piece.length]

    def start_gather(self) -> Callable[[], None]:
        """Start gathering every rank's updated pieces; returns what lands them in the targets."""
        if self.size == 1:
            return self._land_whole
        shard_C = torch.zeros(self.columns, dtype=self.params[0].dtype, device=self.params[0].device)
        for piece in self.pieces:
            shard_C[piece.offset : piece.offset + piece.length] = piece.values
        rows_NC = shard_C.new_empty(self.size, self.columns)
        work = all_gather_single(rows_NC.view(-1), shard_C, group=self.group, async_op=True)

        def land() -> None:
            work.wait()
            with torch.no_grad():
                for piece in self.pieces:
                    _from_rows(rows_NC, piece, piece.target.view(-1))

        return land

    @torch.no_grad()
    def _land_whole(self) -> None:
        for piece in self.pieces:
            if piece.working is not None:
                piece.working.view(-1).copy_(piece.values)

    def gathered(self, piece: _Piece, part: torch.Tensor) -> torch.Tensor:
        """Every rank's `part` (shaped like `piece.values`) of the parameter, at its shape on this
        rank. Collective over the group."""
        if self.size == 1:
            return part.view(piece.shape)
        padded = part.new_zeros(piece.chunk)
        padded[: piece.length] = part
        everyone = part.new_empty(self.size * piece.chunk)
        all_gather_single(everyone, padded, group=self.group)
        return everyone[: piece.numel].view(piece.shape)


class ShardedOptimizer:
    """AdamW over this rank's pieces of the pool's trained parameters (see the module docstring):
    `adamw` steps them (`dyad.optim.apply_update`) and all-gathers the updates; the gradient
    reduction sends `buckets`. `plan` is the trained parameters' (`GradientPlan.trained`)."""

    def __init__(self, plan: GradientPlan, groups: ProcessGroups, train, bucket_bytes: int = BUCKET_BYTES):
        self._buckets: dict[str, list[ShardBucket]] = {}
        self._pieces: dict[int, tuple[ShardBucket, _Piece]] = {}
        for name, params in plan.reduce_over.items():
            size, index = groups.size(name), groups.index(name)
            self._buckets[name] = [
                ShardBucket(bucket, groups.group(name), size, index)
                for bucket in gradient_buckets(list(reversed(params)), bucket_bytes)
            ]
            for bucket in self._buckets[name]:
                self._pieces.update({id(piece.param): (bucket, piece) for piece in bucket.pieces})
        pieces = [piece for _, piece in self._pieces.values()]
        counted = {id(p) for p in plan.counted}
        self._counted = [piece for piece in pieces if id(piece.param) in counted]
        self._world = groups.group("world")
        self.adamw = adamw(
            [piece.values for piece in pieces if decays(piece.param)],
            [piece.values for piece in pieces if not decays(piece.param)],
            train,
        )
        self.adamw.register_step_post_hook(lambda *_: self.gather())
        for piece in pieces:
            if piece.working is not None:
                release(piece.param)

    def buckets(self, name: str) -> list[ShardBucket]:
        """The buckets of the plan's group `name`, in the order every rank sends them."""
        return self._buckets[name]

    def grad_sq_norm(self, device: torch.device | None = None) -> float:
        """The pool's squared gradient norm (float64) from the pieces' summed gradients, the same
        on every rank. Collective over the pool."""
        grads = [piece.values.grad for piece in self._counted if piece.values.grad is not None]
        total = sq_norm(grads, device)
        dist.all_reduce(total, group=self._world)
        return float(total)

    def gather(self) -> None:
        """Every parameter's updated values from the ranks that hold its pieces, into the tensors
        the model computes with. Collective over the pool."""
        landing = deque()
        for buckets in self._buckets.values():
            for bucket in buckets:
                landing.append(bucket.start_gather())
                if len(landing) > GATHERS_IN_FLIGHT:
                    landing.popleft()()
        while landing:
            landing.popleft()()
        forget_quantized(piece.target for _, piece in self._pieces.values())  # llm.fp8's codes

    # What a checkpoint reads and writes (`dyad.checkpoint.OptimizerState`), at each parameter's
    # shape on this rank. A parameter without pieces (a frozen one) is replicated, moments none.

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups

    def value(self, param: nn.Parameter, what: str) -> torch.Tensor:
        """`param`'s float32 values ("param"), an AdamW moment or its summed gradient ("grad"),
        whole (zeros where there is none). Collective over its group where it is needed: all
        but a parameter that is its own master."""
        if id(param) not in self._pieces:
            return param.detach() if what == "param" else torch.zeros_like(param)
        bucket, piece = self._pieces[id(param)]
        if what == "param" and piece.working is None:
            return param.detach()
        parts = {"param": piece.values, "grad": piece.values.grad}
        part = parts[what] if what in parts else self.adamw.state.get(piece.values, {}).get(what)
        return bucket.gathered(piece, piece.values.new_zeros(piece.length) if part is None else part.detach())

    @torch.no_grad()
    def load(self, param: nn.Parameter, what: str, full: torch.Tensor) -> None:
        """This rank's piece of `full` (`param`'s values or a moment, whole) into place; values also
        into the tensor the model computes with."""
        if id(param) not in self._pieces:
            if what == "param":
                param.copy_(full)
            return
        _, piece = self._pieces[id(param)]
        mine = full.reshape(-1)[piece.start : piece.start + piece.length]
        if what == "param":
            piece.target.copy_(full)
            if piece.working is not None:
                piece.values.copy_(mine)
            return
        state = self.adamw.state[piece.values]
        state.setdefault(what, torch.zeros_like(piece.values)).copy_(mine)

    def step_count(self, param: nn.Parameter) -> torch.Tensor:
        """AdamW's step count of `param` (a scalar; every piece of it has the same)."""
        if id(param) not in self._pieces:
            return torch.zeros(())
        return self.adamw.state.get(self._pieces[id(param)][1].values, {}).get("step", torch.zeros(()))

    def load_step_count(self, param: nn.Parameter, step: torch.Tensor) -> None:
        if id(param) in self._pieces:
            set_step_count(self.adamw, self._pieces[id(param)][1].values, step)

    def zero_grad(self) -> None:
        """No gradients: the pieces' and the parameters'."""
        self.adamw.zero_grad(set_to_none=True)
        for _, piece in self._pieces.values():
            piece.param.grad = None

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state once AdamW has stepped: the moments of its pieces,
        and the pieces of working weights' masters."""
        pieces = [piece for _, piece in self._pieces.values()]
        masters = sum(piece.values.nbytes for piece in pieces if piece.working is not None)
        return len(MOMENTS) * sum(piece.values.nbytes for piece in pieces) + masters


def _into_rows(flat: torch.Tensor, rows_NC: torch.Tensor, piece: _Piece) -> None:
    """Chunk j of a parameter's flattened `flat` into row j of its columns of `rows_NC`."""
    full, rest = divmod(piece.numel, piece.chunk) if piece.chunk else (0, 0)
    columns = rows_NC[:, piece.offset : piece.offset + piece.chunk]
    columns[:full].copy_(flat[: full * piece.chunk].view(full, piece.chunk))
    if rest:
        columns[full, :rest].copy_(flat[full * piece.chunk :])


def _from_rows(rows_NC: torch.Tensor, piece: _Piece, flat: torch.Tensor) -> None:
    """The inverse of `_into_rows`: the parameter's chunks from `rows_NC` into `flat`."""
    full, rest = divmod(piece.numel, piece.chunk) if piece.chunk else (0, 0)
    columns = rows_NC[:, piece.offset : piece.offset + piece.chunk]
    flat[: full * piece.chunk].view(full, piece.chunk).copy_(columns[:full])
    if rest:
        flat[full * piece.chunk :].copy_(columns[full, :rest])
