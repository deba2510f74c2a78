"""The loop that runs a pipeline schedule (`dyad.pipeline_schedule`: 1F1B, its interleaved
form, forward passes only) on a pipeline rank, moving activations and their gradients between the
ranks of the pipeline.

Stages are numbered in pipeline order: stage s is chunk s // pp of pipeline rank s % pp
(`dyad.layout.LLMLayout.rank_stages`). Stage s's forward of microbatch m takes stage s - 1's
output of m; its backward takes the gradient of that output from stage s + 1 and returns the
gradient of its input to stage s - 1. `Pipeline.run` walks a rank's list of actions in their
steps (`dyad.pipeline_schedule.steps`: an action, or an interleaved schedule's forward and
backward pair): before each step it sends the previous step's outputs and receives what the step
needs, as one group, waiting for the receives only; it waits for every send at the end.

Why not `torch.distributed.pipelining`: its `PipelineStage` infers the activations' shapes from
the first microbatch of a step and receives every microbatch into buffers of that shape, where
the router plans microbatches of different batch sizes and lengths. Here each rank knows every
microbatch's shapes itself (every rank of the pool collates the same microbatches from the plan:
`StageWork.receive_buffer`), so only activations and their gradients cross between ranks.

Every message carries its own tag (stage, microbatch, direction), so a receive matches its send
whatever order two ranks exchange them in (gloo, where this runs in the tests). A schedule is free
of deadlock when the sends never wait: some order of all ranks' actions then respects both each
rank's order and every dependency (`tests/unit/test_pipeline_schedule.py` walks them all). NCCL
ignores tags and runs two ranks' point-to-point operations in the order each posts them, a large
send finishing only once its receive runs: posting each output alone as soon as it exists
deadlocks 1F1B there. Posted as groups (`dyad.pipeline_schedule.exchanges`, `batch_isend_irecv`),
every schedule gets through under that rule (the same tests walk them). On NCCL it has not run
yet: that needs more than one GPU.

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

from dyad.pipeline_schedule import Action, Exchange, Message, exchanges, steps


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
        """Walk `actions` (this rank's: `schedule` or `forward_only`) in their `steps`, each
        step's inputs received and the previous step's outputs sent as one group
        (`exchanges`); `before_last_backward` is called before the rank's last backward (the
        gradient reduction arms there)."""
        sends: list[tuple[dist.Work, torch.Tensor]] = []  # each with what it sends, alive until done
        sent: dict[tuple[int, int], torch.Tensor] = {}  # outputs whose gradients will come back
        last_backward = next((a for a in reversed(actions) if not a.forward), None)
        plan = exchanges(self.pp, self.pp_rank, actions, self.chunks)
        outputs: list[torch.Tensor] = []  # the previous step's, in its order, as plan[i].sends
        for exchange, step in zip(plan, steps(actions, self.chunks)):
            buffers = []
            for message in exchange.receives:
                chunk = message.dst // self.pp
                if message.forward:
                    buffers.append(work.receive_buffer(chunk, message.microbatch))
                else:
                    buffers.append(torch.empty_like(sent.pop((chunk, message.microbatch))))
            received = dict(zip(exchange.receives, self._exchange(exchange, outputs, buffers, microbatches, sends)))
            outputs = []
            for action in step:
                stage = self.stage(action.chunk)
                if action.forward:
                    h_in = received.get(Message(stage - 1, stage, action.microbatch, True))
                    h_out = work.forward(action.chunk, action.microbatch, h_in)
                    if stage < self.stages - 1:
                        sent[(action.chunk, action.microbatch)] = h_out
                        outputs.append(h_out)
                    continue
                if action == last_backward:
                    before_last_backward()
                grad_out = received.get(Message(stage + 1, stage, action.microbatch, False))
                grad_in = work.backward(action.chunk, action.microbatch, grad_out)
                if stage > 0:
                    outputs.append(grad_in)
        self._exchange(plan[-1], outputs, [], microbatches, sends)
        for send, _ in sends:
            send.wait()

    def _exchange(self, exchange: Exchange, outputs: list[torch.Tensor], buffers: list[torch.Tensor],
                  microbatches: int, sends: list[tuple[dist.Work, torch.Tensor]]) -> list[torch.Tensor]:
        """Post `exchange` as one group: `outputs` sent (its sends'), `buffers` received into (its
        receives'); returns them once they have arrived. The sends' works join `sends`."""
        ops, landings = [], []
        for message, output in zip(exchange.sends, outputs, strict=True):
            tensor = output.detach().contiguous()
            if self.through_host and tensor.is_cuda:
                tensor = tensor.cpu()  # waits for the tensor's kernels: gloo reads the host copy at once
            ops.append(dist.P2POp(dist.isend, tensor, self._rank_of(message.dst), self.group, _tag(message, microbatches)))
        for message, buffer in zip(exchange.receives, buffers, strict=True):
            staged = self.through_host and buffer.is_cuda
            landings.append(torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True) if staged else buffer)
            ops.append(dist.P2POp(dist.irecv, landings[-1], self._rank_of(message.src), self.group,
                                  _tag(message, microbatches)))
        if not ops:
            return []
        # gloo: a work per operation, in order; NCCL: one for the group, which then stands for all
        works = dist.batch_isend_irecv(ops)
        sends += [(works[min(i, len(works) - 1)], ops[i].tensor) for i in range(len(exchange.sends))]
        for work in works[len(exchange.sends):] if len(works) == len(ops) else works:
            work.wait()
        return [buffer if landing is buffer else buffer.copy_(landing) for buffer, landing in zip(buffers, landings)]

    def _rank_of(self, stage: int) -> int:
        return self.ranks[stage % self.pp]

    @cached_property
    def through_host(self) -> bool:
        """Whether CUDA tensors cross through host memory: the group is gloo's."""
        return dist.get_backend(self.group) == dist.Backend.GLOO


def _tag(message: Message, microbatches: int) -> int:
    """The tag of `message`: one per message of a step."""
    return 2 * (message.dst * microbatches + message.microbatch) + (0 if message.forward else 1)
