"""The encoder pool's worker: encode each microbatch's images, send the rows to the LLM ranks
that splice them, receive their gradients and run backward.

Works ahead: up to `boundary.prefetch_depth` microbatches are encoded and sent before the
gradient of the oldest is awaited, so the LLM finds its next input already there.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from dyad.encoder_service.step import encode_rows
from dyad.service import PoolService, boundary_dtype, compute_context
from dyad.transport import Direction, MessageTag
from dyad.wire import pb


@dataclass
class InFlight:
    transfer: pb.Transfer
    rows_RD: torch.Tensor  # encoder output, still attached to the graph
    sent: Future
    grad_received: Future


class EncoderWorker(PoolService):
    pool = "encoder"

    def step(self, command: pb.StepCommand) -> pb.StepResult:
        self.lr = command.lr
        self.model.train()
        transfers = [t for t in command.plan.transfers if t.src_rank == self.rank]
        todo = deque(transfers)
        in_flight: deque[InFlight] = deque()
        bytes_sent = bytes_received = 0
        wait_s = 0.0
        depth = self.config.boundary.prefetch_depth
        while todo or in_flight:
            while todo and len(in_flight) < depth:
                in_flight.append(self._encode_and_send(command.step, todo.popleft()))
                bytes_sent += in_flight[-1].rows_RD.nbytes
            oldest = in_flight.popleft()
            waited = time.perf_counter()
            grad_RD = oldest.grad_received.result()
            wait_s += time.perf_counter() - waited
            bytes_received += grad_RD.nbytes
            oldest.rows_RD.backward(grad_RD)
            oldest.sent.result()
        return pb.StepResult(
            step=command.step,
            grad_sq_norm=self.grad_sq_norm(),
            boundary_bytes_sent=bytes_sent,
            boundary_bytes_received=bytes_received,
            boundary_wait_s=wait_s,
        )

    def _encode_and_send(self, step: int, transfer: pb.Transfer) -> InFlight:
        with compute_context(self.config):
            rows_RD = encode_rows(self.model, self.dataset, transfer.image_ids, self.device)
        rows_RD = rows_RD.to(boundary_dtype(self.config))
        if rows_RD.shape[0] != transfer.rows:
            raise RuntimeError(
                f"step {step} microbatch {transfer.microbatch}: encoded {rows_RD.shape[0]} rows, "
                f"the plan says {transfer.rows}"
            )
        peer = self.peers[(pb.POOL_LLM, transfer.dst_rank)]
        forward = MessageTag(self.run_id, step, transfer.microbatch, Direction.FORWARD, self.rank)
        backward = MessageTag(
            self.run_id, step, transfer.microbatch, Direction.BACKWARD, transfer.dst_rank
        )
        grad_RD = torch.empty_like(rows_RD)
        return InFlight(
            transfer=transfer,
            rows_RD=rows_RD,
            grad_received=self.transport.recv(peer, backward, grad_RD),
            sent=self.transport.send(peer, forward, rows_RD.detach().contiguous()),
        )
