"""The LLM pool's worker: for each microbatch of this rank's data-parallel group, receive the
image-token rows the plan routes here, splice the ones inside this rank's context shard, run
forward and backward, and send the rows' gradient back where the plan says.

Every receive of the step is posted up front, so rows the encoder sends early land while this
rank is still busy with an earlier microbatch.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from dyad.data import collate
from dyad.llm_service.moe import update_expert_biases
from dyad.llm_service.parallelize import parallelize_llm
from dyad.llm_service.sharding import shard_microbatch
from dyad.llm_service.step import microbatch_loss
from dyad.service import PoolService, boundary_dtype, compute_context
from dyad.transport import Direction, MessageTag
from dyad.wire import pb


class LLMWorker(PoolService):
    pool = "llm"

    def parallelize(self, model, groups):
        return parallelize_llm(model, groups, sequence_parallel=self.config.parallel.sequence_parallel)

    def step(self, command: pb.StepCommand) -> pb.StepResult:
        self.lr = command.lr
        self.model.train()
        mine = [t for t in command.plan.transfers if t.dst_rank == self.rank]
        received = {t.microbatch: [] for t in mine}
        for transfer in mine:
            received[transfer.microbatch].append((transfer, self._post_receive(command, transfer)))

        dp_rank, tp_rank = self.groups.index("dp"), self.groups.index("tp")
        lm_sum = aux_sum = 0.0
        bytes_sent = bytes_received = 0
        wait_s = 0.0
        sends: list[Future] = []
        for microbatch in command.microbatches:
            if microbatch.llm_dp_rank != dp_rank:
                continue
            samples = [self.dataset.sample(s) for s in microbatch.sample_ids]
            batch = collate(self.dataset.tokenizer, samples, command.plan.tokens_per_image)
            local = shard_microbatch(
                batch.to(self.device),
                pad_id=self.dataset.tokenizer.pad_id,
                cp=self.layout.cp,
                cp_rank=self.groups.index("cp"),
                tp=self.layout.tp,
            )
            arrivals = received.get(microbatch.index, [])
            waited = time.perf_counter()
            rows_RD = self._rows(command.step, microbatch, batch, arrivals)
            wait_s += time.perf_counter() - waited
            with compute_context(self.config):
                loss = microbatch_loss(
                    self.model,
                    local,
                    None if rows_RD is None else rows_RD[local.image_rows_Nl],
                    global_target_tokens=command.global_target_tokens,
                    global_microbatches=command.global_microbatches,
                )
            loss.total.backward()
            lm_sum += loss.lm if tp_rank == 0 else 0.0  # tp ranks hold the same loss
            aux_sum += loss.aux  # each rank holds its share
            if rows_RD is not None:
                bytes_received += rows_RD.nbytes * len(arrivals)
                returned = self._send_gradients(command.step, arrivals, rows_RD.grad)
                sends += returned
                bytes_sent += rows_RD.grad.nbytes if returned else 0
        update_expert_biases(self.model, group=self.groups.group("world"))
        for sent in sends:
            sent.result()
        return pb.StepResult(
            step=command.step,
            grad_sq_norm=self.finish_backward(),
            lm_loss_sum=lm_sum,
            aux_loss=aux_sum,
            boundary_bytes_sent=bytes_sent,
            boundary_bytes_received=bytes_received,
            boundary_wait_s=wait_s,
        )

    def _post_receive(self, command: pb.StepCommand, transfer: pb.Transfer) -> Future:
        peer = self.peers[(pb.POOL_ENCODER, transfer.src_rank)]
        tag = MessageTag(
            self.run_id, command.step, transfer.microbatch, Direction.FORWARD, transfer.src_rank
        )
        rows_RD = torch.empty(
            (transfer.rows, command.plan.hidden), dtype=boundary_dtype(self.config), device=self.device
        )
        return self.transport.recv(peer, tag, rows_RD)

    def _rows(self, step, microbatch, batch, arrivals) -> torch.Tensor | None:
        """The microbatch's image rows in splice order, as a leaf that collects their gradient."""
        planned = tuple(i for transfer, _ in arrivals for i in transfer.image_ids)
        if planned != tuple(batch.image_ids):
            raise RuntimeError(
                f"step {step} microbatch {microbatch.index}: the plan delivers images {planned}, "
                f"the samples need {tuple(batch.image_ids)}"
            )
        if not arrivals:
            return None
        rows_RD = torch.cat([arrived.result() for _, arrived in arrivals])
        return rows_RD.requires_grad_(True)

    def _send_gradients(self, step, arrivals, grad_RD: torch.Tensor) -> list[Future]:
        sends, start = [], 0
        for transfer, _ in arrivals:
            if transfer.returns_gradient:
                peer = self.peers[(pb.POOL_ENCODER, transfer.src_rank)]
                tag = MessageTag(self.run_id, step, transfer.microbatch, Direction.BACKWARD, self.rank)
                sends.append(self.transport.send(peer, tag, grad_RD[start : start + transfer.rows].contiguous()))
            start += transfer.rows
        return sends
