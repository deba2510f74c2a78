"""The encoder pool's worker: encode the microbatches the plan gives this rank's data-parallel
group, send the rows to the LLM ranks that splice them, receive their gradients and run backward.

Tensor-parallel ranks of a group compute together; only the group's tp rank 0 talks to the LLM
(it sends the rows, sums the returned gradient shares and broadcasts the sum to its group).

Works ahead: up to `boundary.prefetch_depth` microbatches are encoded and sent before the
gradient of the oldest is awaited, so the LLM finds its next input already there.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import groupby

import torch
import torch.distributed as dist

from dyad.encoder_service.parallelize import parallelize_encoder
from dyad.encoder_service.step import encode_rows
from dyad.service import PoolService, boundary_dtype, compute_context
from dyad.transport import Direction, MessageTag
from dyad.wire import pb


@dataclass
class InFlight:
    microbatch: int
    rows_RD: torch.Tensor  # encoder output, still attached to the graph
    sent: list[Future] = field(default_factory=list)
    gradients: list[Future] = field(default_factory=list)  # one share per returning LLM rank


class EncoderWorker(PoolService):
    pool = "encoder"

    def parallelize(self, model, groups):
        return parallelize_encoder(model, groups)

    @property
    def talks_to_llm(self) -> bool:
        return self.groups.index("tp") == 0

    def step(self, command: pb.StepCommand) -> pb.StepResult:
        self.lr = command.lr
        self.model.train()
        source = self.layout.rank(tp=0, dp=self.groups.index("dp"))
        mine = [t for t in command.plan.transfers if t.src_rank == source]
        todo = deque(list(group) for _, group in groupby(mine, key=lambda t: t.microbatch))
        in_flight: deque[InFlight] = deque()
        bytes_sent = bytes_received = 0
        wait_s = 0.0
        while todo or in_flight:
            while todo and len(in_flight) < self.config.boundary.prefetch_depth:
                in_flight.append(self._encode_and_send(command.step, todo.popleft()))
                bytes_sent += in_flight[-1].rows_RD.nbytes * len(in_flight[-1].sent)
            oldest = in_flight.popleft()
            waited = time.perf_counter()
            grad_RD = self._gradient(oldest)
            wait_s += time.perf_counter() - waited
            bytes_received += grad_RD.nbytes * len(oldest.gradients)
            oldest.rows_RD.backward(grad_RD)
            for sent in oldest.sent:
                sent.result()
        return pb.StepResult(
            step=command.step,
            grad_sq_norm=self.finish_backward(),
            boundary_bytes_sent=bytes_sent,
            boundary_bytes_received=bytes_received,
            boundary_wait_s=wait_s,
        )

    def _encode_and_send(self, step: int, transfers: list[pb.Transfer]) -> InFlight:
        first = transfers[0]
        with compute_context(self.config):
            rows_RD = encode_rows(self.model, self.dataset, first.image_ids, self.device)
        rows_RD = rows_RD.to(boundary_dtype(self.config))
        if rows_RD.shape[0] != first.rows:
            raise RuntimeError(
                f"step {step} microbatch {first.microbatch}: encoded {rows_RD.shape[0]} rows, "
                f"the plan says {first.rows}"
            )
        flight = InFlight(microbatch=first.microbatch, rows_RD=rows_RD)
        if not self.talks_to_llm:
            return flight
        payload = rows_RD.detach().contiguous()
        for transfer in transfers:
            peer = self.peers[(pb.POOL_LLM, transfer.dst_rank)]
            tag = MessageTag(self.run_id, step, transfer.microbatch, Direction.FORWARD, self.rank)
            flight.sent.append(self.transport.send(peer, tag, payload))
            if transfer.returns_gradient:
                back = MessageTag(
                    self.run_id, step, transfer.microbatch, Direction.BACKWARD, transfer.dst_rank
                )
                flight.gradients.append(self.transport.recv(peer, back, torch.empty_like(payload)))
        return flight

    def _gradient(self, flight: InFlight) -> torch.Tensor:
        """The rows' full gradient: the sum of the returned shares, on every tp rank."""
        grad_RD = torch.zeros_like(flight.rows_RD)
        for share in flight.gradients:
            grad_RD += share.result()
        if self.layout.tp > 1:
            dist.broadcast(grad_RD, src=self.groups.ranks("tp")[0], group=self.groups.group("tp"))
        return grad_RD
