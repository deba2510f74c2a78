"""Gradient reduction overlapped with a step's last backward pass, as data-parallel training
does it (torch DDP, Megatron-LM's distributed data parallel): each bucket of gradients is summed
over its group as soon as the backward pass has finished every gradient in it, while the pass
goes on with earlier layers, instead of all of them after the pass.

The sums are those of `reduce_gradients` (the reference: the same buckets' values over the same
groups, `tests/dist/test_overlapped_reduction.py`). What must hold for that:
- Only the last backward of a step arms the reduction (`arm()`); earlier microbatches only
  accumulate. A bucket goes when each of its parameters' gradients has been accumulated in the
  armed pass (a post-accumulate-grad hook), so its values are final.
- Each group's buckets go in one fixed order (its parameters' reverse registration order, the
  order backward mostly produces them), whatever order their hooks fire in: every rank of a
  group launches the same collectives in the same order, as NCCL requires.
- Gradients that no hook reports (a parameter the last microbatch did not reach, or the expert
  weights whose gradients `dyad/kernels/expert_weight_grads.py` adds into `.grad` itself) hold their
  bucket, and the group's later buckets, until `finish()`, which sends everything left (zeros
  for a parameter without a gradient) and waits for all of it.
- A bucket of several gradients is summed in a flat copy and copied back; at most
  `max_copies_in_flight` such copies live at once (older ones are waited for and copied back
  first), so the extra memory stays a few buckets, not the model's gradients.

With the optimizer sharded (`dyad/parallel/sharded_optimizer.py`, `into=`) the buckets are its
own: the same parameters in the same order, each reduce-scattered from a copy (bounded as
above) into this rank's pieces, the parameters' gradients dropped once copied.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from dyad.kernels.master_weights import register_accumulated_hook
from dyad.parallel.buckets import BUCKET_BYTES, COPIES_IN_FLIGHT
from dyad.parallel.gradients import (
    GradientPlan,
    copy_back,
    gradient_buckets,
    grads_or_zeros,
    start_all_reduce,
)
from dyad.parallel.groups import ProcessGroups


@dataclass
class Sent:
    """A bucket's collective in flight."""

    work: dist.Work | None  # None: nothing to wait for
    flat: torch.Tensor | None  # a copy of the bucket's gradients the collective reads, or None
    then: Callable[[], None] = lambda: None  # once the work is done: the sums to where they go


class Bucket(Protocol):
    """Gradients that go over their group in one collective."""

    params: list[nn.Parameter]

    def send(self) -> Sent:
        """Start the collective over the bucket's gradients, whose values are final."""


class SummedBucket:
    """A bucket summed in place over its group (an all-reduce)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup):
        self.params, self.group = params, group

    def send(self) -> Sent:
        grads = list(grads_or_zeros(self.params))
        work, flat = start_all_reduce(grads, self.group, async_op=True)
        return Sent(work, flat, functools.partial(copy_back, flat, grads) if flat is not None else lambda: None)


class BucketSource(Protocol):
    """Who else cuts the plan's groups into buckets (the sharded optimizer: its buckets
    reduce-scatter into its shards)."""

    def buckets(self, name: str) -> list[Bucket]: ...


@dataclass
class _Lane:
    """One group's buckets, the next one to send, and which parameters of each have reported."""

    buckets: list[Bucket]
    next: int = 0
    reported: list[set[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.next, self.reported = 0, [set() for _ in self.buckets]

    def complete(self, index: int) -> bool:
        return len(self.reported[index]) == len(self.buckets[index].params)


class GradientReduction:
    """A pool's gradient reduction for one step: `arm()` before its last backward pass, then
    `finish()`. With `overlap=False` no hooks are registered and `finish()` sends every bucket
    after the pass (`train.overlap_grad_reduce: false`). The buckets sum each group's gradients
    in place, or, given `into` (`dyad.parallel.sharded_optimizer`), are its buckets, which
    reduce-scatter them into its shards; its groups of one rank send too."""

    def __init__(
        self,
        plan: GradientPlan,
        groups: ProcessGroups,
        bucket_bytes: int = BUCKET_BYTES,
        max_copies_in_flight: int = COPIES_IN_FLIGHT,
        overlap: bool = True,
        into: BucketSource | None = None,
    ):
        self.max_copies_in_flight = max_copies_in_flight
        self.lanes: list[_Lane] = []
        self.armed = False
        self.sent: deque[Sent] = deque()
        for name, params in plan.reduce_over.items():
            if into is not None:
                lane = _Lane(into.buckets(name))
            elif groups.size(name) > 1:
                buckets = gradient_buckets(list(reversed(params)), bucket_bytes)
                lane = _Lane([SummedBucket(bucket, groups.group(name)) for bucket in buckets])
            else:
                continue
            self.lanes.append(lane)
            for index, bucket in enumerate(lane.buckets if overlap else []):
                for param in bucket.params:
                    register_accumulated_hook(param, functools.partial(self._accumulated, lane, index))

    def arm(self) -> None:
        """The next backward pass is the step's last: send buckets as it completes them."""
        self.armed = True

    def finish(self) -> None:
        """After the last backward pass: send what is left, wait for every collective, put the
        sums in place."""
        self.armed = False
        for lane in self.lanes:
            while lane.next < len(lane.buckets):
                self._send(lane)
        while self.sent:
            self._land(self.sent.popleft())
        for lane in self.lanes:
            lane.reset()

    def _accumulated(self, lane: _Lane, index: int, param: nn.Parameter) -> None:
        if not self.armed:
            return
        lane.reported[index].add(id(param))
        while lane.next < len(lane.buckets) and lane.complete(lane.next):
            self._send(lane)

    def _send(self, lane: _Lane) -> None:
        self.sent.append(lane.buckets[lane.next].send())
        lane.next += 1
        while sum(sent.flat is not None for sent in self.sent) > self.max_copies_in_flight:
            self._land(self._oldest_copy())

    def _oldest_copy(self) -> Sent:
        oldest = next(sent for sent in self.sent if sent.flat is not None)
        self.sent.remove(oldest)
        return oldest

    def _land(self, sent: Sent) -> None:
        """Wait for the collective (on CUDA: the current stream waits, not the host), then put
        its sums in place."""
        if sent.work is not None:
            sent.work.wait()
        sent.then()
