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
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dyad.kernels.master_weights import register_accumulated_hook
from dyad.parallel.gradients import (
    BUCKET_BYTES,
    GradientPlan,
    copy_back,
    gradient_buckets,
    grads_or_zeros,
    start_all_reduce,
)
from dyad.parallel.groups import ProcessGroups


@dataclass
class _Lane:
    """One group's buckets, the next one to send, and which parameters of each have reported."""

    group: dist.ProcessGroup
    buckets: list[list[nn.Parameter]]
    next: int = 0
    reported: list[set[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.next, self.reported = 0, [set() for _ in self.buckets]

    def complete(self, index: int) -> bool:
        return len(self.reported[index]) == len(self.buckets[index])


@dataclass
class _Sent:
    work: dist.Work
    flat: torch.Tensor | None  # the summed copy of several gradients, or None: summed in place
    grads: list[torch.Tensor]


class GradientReduction:
    """A pool's gradient reduction for one step: `arm()` before its last backward pass, then
    `finish()`. With `overlap=False` no hooks are registered and `finish()` sends every bucket
    after the pass (`train.overlap_grad_reduce: false`)."""

    def __init__(
        self,
        plan: GradientPlan,
        groups: ProcessGroups,
        bucket_bytes: int = BUCKET_BYTES,
        max_copies_in_flight: int = 2,
        overlap: bool = True,
    ):
        self.max_copies_in_flight = max_copies_in_flight
        self.lanes: list[_Lane] = []
        self.armed = False
        self.sent: deque[_Sent] = deque()
        for name, params in plan.reduce_over.items():
            if groups.size(name) == 1:
                continue
            lane = _Lane(groups.group(name), list(gradient_buckets(list(reversed(params)), bucket_bytes)))
            self.lanes.append(lane)
            for index, bucket in enumerate(lane.buckets if overlap else []):
                for param in bucket:
                    register_accumulated_hook(param, functools.partial(self._accumulated, lane, index))

    def arm(self) -> None:
        """The next backward pass is the step's last: send buckets as it completes them."""
        self.armed = True

    def finish(self) -> None:
        """After the last backward pass: send what is left, wait for every sum, copy back."""
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
        grads = list(grads_or_zeros(lane.buckets[lane.next]))
        lane.next += 1
        work, flat = start_all_reduce(grads, lane.group, async_op=True)
        self.sent.append(_Sent(work, flat, grads))
        while sum(sent.flat is not None for sent in self.sent) > self.max_copies_in_flight:
            self._land(self._oldest_copy())

    def _oldest_copy(self) -> _Sent:
        oldest = next(sent for sent in self.sent if sent.flat is not None)
        self.sent.remove(oldest)
        return oldest

    def _land(self, sent: _Sent) -> None:
        """Wait for the sum (on CUDA: the current stream waits, not the host) and copy it back."""
        sent.work.wait()
        if sent.flat is not None:
            copy_back(sent.flat, sent.grads)
