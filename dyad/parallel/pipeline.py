"""The loop that runs a pipeline schedule (`dyad.pipeline_schedule`: 1F1B, its interleaved
form, forward passes only) on a pipeline rank, moving activations and their gradients between the
ranks of the pipeline.

Stages are numbered in pipeline order: stage s is chunk s // pp of pipeline rank s % pp
(`dyad.layout.LLMLayout.rank_stages`). Stage s's forward of microbatch m takes stage s - 1's
output of m; its backward takes the gradient of that output from stage s + 1 and returns the
gradient of its input to stage s - 1. `Pipeline.run` walks a rank's list of actions: it receives
what an action needs just before it (blocking), sends what it produces without waiting, and
waits for every send at the end.

Why not `torch.distributed.pipelining`: its `PipelineStage` infers the activations' shapes from
the first microbatch of a step and receives every microbatch into buffers of that shape, where
the router plans microbatches of different batch sizes and lengths. Here each rank knows every
microbatch's shapes itself (every rank of the pool collates the same microbatches from the plan:
`StageWork.receive_buffer`), so only activations and their gradients cross between ranks.

Every message carries its own tag (stage, microbatch, direction), so a receive matches its send
whatever order two ranks exchange them in. A schedule is free of deadlock when the sends never
wait: some order of all ranks' actions then respects both each rank's order and every
dependency (`tests/unit/test_pipeline_schedule.py` walks them all). That holds on gloo, where
this runs in the tests. NCCL ignores tags and runs two ranks' point-to-point operations in order
on one stream, where a large send waits for its receive: the schedules do exchange the messages
between any two ranks in one order on both sides, but whether a send queued ahead of a receive
stalls (Megatron-LM issues such pairs together, `batch_isend_irecv`) has not been run on GPUs yet.

Over gloo (every pool on CPUs, and several ranks sharing one GPU, where NCCL refuses to run) CUDA
tensors go through host memory: gloo's point-to-point operations read and write their buffers as
host memory, so a CUDA output is copied to the host before its send and a receive lands in a host
buffer that is then copied to the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.distributed as dist

from dyad.pipeline_schedule import Action


class StageWork(Protocol):
    """What a pipeline rank computes; `run` moves the tensors between ranks."""

    def receive_buffer(self, chunk: int, microbatch: int) -> torch.Tensor:
        """An empty tensor of the shape and dtype of the input the previous stage sends for it."""

    def forward(self, chunk: int, microbatch: int, h_in: torch.Tensor | None) -> torch.Tensor | None:
        """The forward pass of a chunk (`h_in`: the previous stage's output, None on the first
        stage); returns the output the next stage takes (None on the last stage)."""

    def backward(self, chunk: int, microbatch: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """The backward pass of a chunk from its output's gradient (None on the last stage);
        returns its input's gradient (None on the first stage)."""


@dataclass(frozen=True)
class Pipeline:
    """One pipeline: its ranks in stage order (`ranks[i]`: pipeline rank i's global rank), the
    group they talk over, how many stages and this rank's place in it."""

    ranks: list[int]
    group: dist.ProcessGroup
    pp_rank: int
    chunks: int

    @property
    def pp(self) -> int:
        return len(self.ranks)

    @property
    def stages(self) -> int:
        return self.pp * self.chunks

    def stage(self, chunk: int) -> int:
        return chunk * self.pp + self.pp_rank

    def run(self, actions: list[Action], work: StageWork, microbatches: int,
            before_last_backward: Callable[[], None] = lambda: None) -> None:
        """Walk `actions` (this rank's: `schedule` or `forward_only`); `before_last_backward` is
        called before the rank's last backward (the gradient reduction arms there)."""
        sends: list[tuple[dist.Work, torch.Tensor]] = []  # each with what it sends, alive until done
        sent: dict[tuple[int, int], torch.Tensor] = {}  # outputs whose gradients will come back
        last_backward = max((i for i, a in enumerate(actions) if not a.forward), default=-1)
        for index, action in enumerate(actions):
            chunk, m = action.chunk, action.microbatch
            stage = self.stage(chunk)
            if action.forward:
                h_in = None
                if stage > 0:
                    h_in = self._receive(work.receive_buffer(chunk, m), stage - 1, _tag(stage, m, microbatches, forward=True))
                h_out = work.forward(chunk, m, h_in)
                if stage < self.stages - 1:
                    sends.append(self._send(h_out, stage + 1, _tag(stage + 1, m, microbatches, forward=True)))
                    sent[(chunk, m)] = h_out
                continue
            grad_out = None
            if stage < self.stages - 1:
                h_out = sent.pop((chunk, m))
                grad_out = self._receive(torch.empty_like(h_out), stage + 1, _tag(stage, m, microbatches, forward=False))
            if index == last_backward:
                before_last_backward()
            grad_in = work.backward(chunk, m, grad_out)
            if stage > 0:
                sends.append(self._send(grad_in, stage - 1, _tag(stage - 1, m, microbatches, forward=False)))
        for send, _ in sends:
            send.wait()

    @cached_property
    def through_host(self) -> bool:
        """Whether CUDA tensors cross through host memory: the group is gloo's."""
        return dist.get_backend(self.group) == dist.Backend.GLOO

    def _receive(self, buffer: torch.Tensor, stage: int, tag: int) -> torch.Tensor:
        staged = self.through_host and buffer.is_cuda
        landing = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True) if staged else buffer
        dist.irecv(landing, src=self.ranks[stage % self.pp], group=self.group, tag=tag).wait()
        return buffer.copy_(landing) if staged else buffer

    def _send(self, tensor: torch.Tensor, stage: int, tag: int) -> tuple[dist.Work, torch.Tensor]:
        tensor = tensor.detach().contiguous()
        if self.through_host and tensor.is_cuda:
            tensor = tensor.cpu()  # waits for the tensor's kernels: gloo reads the host copy at once
        return dist.isend(tensor, dst=self.ranks[stage % self.pp], group=self.group, tag=tag), tensor


def _tag(stage: int, microbatch: int, microbatches: int, *, forward: bool) -> int:
    """The tag of the message into `stage` (forward: its input) or out of it (backward: its
    output's gradient) for `microbatch`: one per message of a step."""
    return 2 * (stage * microbatches + microbatch) + (0 if forward else 1)
