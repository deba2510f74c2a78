"""The LLM pool's worker: for each microbatch of this rank's data-parallel group, receive
exactly the image-token rows of its context shard (tp rank 0 gets one packed buffer per encoder
peer and broadcasts the rows to its tp group), splice them, run forward and backward, and send
each row's gradient back exactly once (tp rank 0 does).

With pipeline parallelism (parallel.llm.pp > 1) the microbatches go through the rank's stages in
the pipeline's schedule (`dyad.parallel.pipeline`: 1F1B, or interleaved with pp_virtual > 1);
only first-stage ranks receive image rows and return their gradients, the last stage computes
the caption loss, every stage its layers' aux losses.

Every receive of the step is posted up front, so rows the encoder sends early land while this
rank is still busy with an earlier microbatch. An evaluation runs the same microbatches forward
only, batch by batch, and sends nothing back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from dyad.data import ImageTokens, answer_targets
from dyad.data.batch import collate
from dyad.exposed_wait import ExposedWait
from dyad.hf_checkpoint import HFCheckpoint
from dyad.kernels.boundary_pack import RowSegments, pack, unpack_into
from dyad.llm_service.fp8 import convert_to_fp8
from dyad.llm_service.hf import llm_sources
from dyad.llm_service.hf_config import text_config
from dyad.llm_service.model import MoELM
from dyad.llm_service.moe import update_expert_biases
from dyad.llm_service.parallelize import parallelize_llm
from dyad.llm_service.pipeline import StageHeldOut, StageMicrobatch, StageSteps
from dyad.llm_service.sharding import shard_microbatch
from dyad.llm_service.step import HeldOut, held_out, heldout_microbatch, microbatch_loss
from dyad.parallel.pipeline import Pipeline
from dyad.pipeline_schedule import forward_only, schedule
from dyad.service import PoolService, boundary_dtype, compute_context, transfer_segments
from dyad.slices import load_pieces
from dyad.transport import Direction, MessageTag, Phase
from dyad.wire import pb

log = logging.getLogger(__name__)
_VOCABULARY_ROWS = ("tok_embeddings.weight", "output.weight")


@dataclass
class Arrival:
    """One peer's packed rows for a microbatch: where they land, and the pending receive."""

    transfer: pb.Transfer
    segments: RowSegments
    buffer_ND: torch.Tensor
    received: Future


@dataclass
class Trained:
    """What a step's passes leave to report: the losses summed in float64 on the device (read, a
    host sync, once the step's work is queued), the boundary bytes, the gradient sends."""

    lm: torch.Tensor
    aux: torch.Tensor
    bytes_sent: int = 0
    bytes_received: int = 0
    sends: list[Future] = field(default_factory=list)


class Taken(Sequence):
    """A step's inputs (`LLMWorker._inputs`: microbatch, shard, image rows, their arrivals), each
    taken, its rows waited for, when a pass first asks for it: the first stage asks in microbatch
    order, so the encoder's rows of later microbatches may still be on their way."""

    def __init__(self, inputs, count: int):
        self._inputs, self._count, self.items = iter(inputs), count, []

    def __getitem__(self, m: int) -> StageMicrobatch:
        while len(self.items) <= m:
            self.items.append(next(self._inputs))
        _, local, rows_NlD, _ = self.items[m]
        return StageMicrobatch(local, rows_NlD)

    def __len__(self) -> int:
        return self._count


class LLMWorker(PoolService):
    pool = "llm"

    @staticmethod
    def single_device_model(config) -> MoELM:
        model = MoELM(config.llm)
        if config.llm.fp8:
            convert_to_fp8(model)
        return model

    @staticmethod
    def load_pretrained(model: MoELM, config) -> None:
        """The `llm.from_hf` checkpoint's weights, those of the tensors `model` holds (a pipeline
        stage's, under pipeline parallelism); rows the tokenizer added past its embedding keep
        their drawn values."""
        if not config.llm.from_hf:
            return
        checkpoint = HFCheckpoint(config.llm.from_hf)
        rows = text_config(checkpoint.config)["vocab_size"]
        sources = llm_sources(checkpoint, dataclasses.replace(config.llm, vocab_size=rows))
        held = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
        sources = {name: source for name, source in sources.items() if name in held}
        load_pieces(model, sources, rows=dict.fromkeys(_VOCABULARY_ROWS, config.llm.vocab_size))
        log.info("loaded the weights of %s", config.llm.from_hf)

    @staticmethod
    def freeze(model: MoELM, config) -> None:
        """train.freeze "llm": every parameter (and its MoE layers' expert biases stay put)."""
        if "llm" in config.train.freeze:
            model.requires_grad_(False)

    def parallelize(self, model, groups):
        return parallelize_llm(model, groups, sequence_parallel=self.config.parallel.sequence_parallel)

    @cached_property
    def pipeline(self) -> Pipeline:
        return Pipeline(self.groups.ranks("pp"), self.groups.group("pp"), self.groups.index("pp"), self.layout.pp_virtual)

    @property
    def splices(self) -> bool:
        """Whether this rank splices image rows: one of the first pipeline stage's."""
        return self.groups.index("pp") == 0

    @property
    def computes_logits(self) -> bool:
        """Whether this rank computes the logits and the caption loss: one of the last stage's."""
        return self.layout.stages - 1 in self.layout.rank_stages(self.groups.index("pp"))

    def step(self, command: pb.StepCommand) -> pb.StepResult:
        self.lr = command.lr
        self.model.train()
        arrivals = self._post_receives(command, Phase.TRAIN)
        waits = ExposedWait(self.device)
        ours = self._microbatches_of_this_lane(command)
        inputs = self._inputs(command, ours, arrivals, waits)
        passes = self._pipelined if self.layout.pp > 1 else self._one_at_a_time
        trained = passes(command, len(ours), inputs)
        # Before the biases' all-reduce over the stage: the gradient reduction may still have
        # buckets of that group to send, and every rank must send them in the same order.
        grad_sq_norm = self.finish_backward()
        if "llm" not in self.config.train.freeze:
            update_expert_biases(self.model, group=self.groups.group("stage"))
        for sent in trained.sends:
            sent.result()
        waited = waits.each_seconds()
        return pb.StepResult(
            step=command.step,
            grad_sq_norm=grad_sq_norm,
            lm_loss_sum=float(trained.lm),
            aux_loss=float(trained.aux),
            boundary_bytes_sent=trained.bytes_sent,
            boundary_bytes_received=trained.bytes_received,
            boundary_wait_s=sum(waited),
            boundary_fill_wait_s=waited[0] if waited else 0.0,
            peak_memory_gb=self.peak_memory_gb(),
        )

    def _one_at_a_time(self, command: pb.StepCommand, count: int, inputs) -> Trained:
        """Each microbatch's forward and backward in turn, the whole model on this rank."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        trained = Trained(zero, zero)
        for position, (_, local, rows_NlD, mine) in enumerate(inputs):
            trained.bytes_received += sum(arrival.buffer_ND.nbytes for arrival in mine)
            with compute_context(self.config):
                loss = microbatch_loss(
                    self.model,
                    local,
                    rows_NlD,
                    global_target_tokens=command.global_target_tokens,
                    global_microbatches=command.global_microbatches,
                )
            if position == count - 1:
                self.reduction.arm()  # the step's last backward: reduce buckets as it ends them
            if loss.total.requires_grad:  # not where nothing before it trains (a frozen LLM, no images)
                loss.total.backward()
            if self.groups.index("tp") == 0:  # tp ranks hold the same loss
                trained.lm = trained.lm + loss.lm
            trained.aux = trained.aux + loss.aux  # each rank holds its share
            self._return_gradients(trained, command.step, rows_NlD, mine)
        return trained

    def _pipelined(self, command: pb.StepCommand, count: int, inputs) -> Trained:
        """The microbatches through this rank's pipeline stages in the pipeline's schedule."""
        taken = Taken(inputs, count)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        trained = Trained(zero, zero)

        def returned(m: int) -> None:  # microbatch m's image rows have their gradient
            _, _, rows_NlD, mine = taken.items[m]
            trained.bytes_received += sum(arrival.buffer_ND.nbytes for arrival in mine)
            self._return_gradients(trained, command.step, rows_NlD, mine)

        work = StageSteps(
            self.model, self.layout, self.groups.index("pp"), taken, device=self.device,
            global_target_tokens=command.global_target_tokens, global_microbatches=command.global_microbatches,
            compute=lambda: compute_context(self.config), returned=returned,
        )
        actions = schedule(self.layout.pp, self.groups.index("pp"), count, self.layout.pp_virtual)
        self.pipeline.run(actions, work, count, before_last_backward=self.reduction.arm)
        if self.groups.index("tp") == 0:  # tp ranks hold the same loss; 0 but on the last stage
            trained.lm = work.lm
        trained.aux = work.aux  # each rank holds its share
        return trained

    def _return_gradients(self, trained: Trained, step: int, rows_NlD, mine) -> None:
        if rows_NlD is not None and rows_NlD.requires_grad:  # not to a frozen encoder
            returned = self._send_gradients(step, mine, rows_NlD.grad)
            trained.sends += [future for future, _ in returned]
            trained.bytes_sent += sum(nbytes for _, nbytes in returned)

    @torch.no_grad()
    def evaluate(self, command: pb.EvalCommand) -> pb.EvalResult:
        """The held-out batches' caption loss and answer checks (tp rank 0 of each shard of the
        last stage reports them: its tp group holds the same), forward only: the image rows'
        gradients stay here."""
        self.model.eval()
        reports = self.groups.index("tp") == 0 and self.computes_logits
        lm_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        answers: dict[int, list[int]] = {}
        received = 0
        for batch in command.batches:
            arrivals = self._post_receives(batch, Phase.EVAL)
            ours = self._microbatches_of_this_lane(batch)
            inputs = self._inputs(batch, ours, arrivals, ExposedWait(self.device))
            held_out_of = self._pipelined_held_out if self.layout.pp > 1 else self._held_out
            results, batch_received = held_out_of(batch, len(ours), inputs)
            received += batch_received
            for microbatch, spans, held in results:
                lm_sum = lm_sum + held.lm
                checks = zip(microbatch.sample_ids, spans, held.checked_B.tolist(), held.wrong_B.tolist())
                for sample_id, span, checked, wrong in checks:
                    if span:
                        answers[sample_id] = [checked, wrong]
        return pb.EvalResult(
            step=command.step,
            lm_loss_sum=float(lm_sum) if reports else 0.0,
            answers=[
                pb.AnswerCheck(sample_id=s, checked=checked, wrong=wrong) for s, (checked, wrong) in answers.items()
            ] if reports else [],
            boundary_bytes_received=received,
        )

    def _held_out(self, batch: pb.StepCommand, count: int, inputs) -> tuple[list, int]:
        """([(microbatch, its answer spans, its HeldOut)], the image bytes received)."""
        results, received = [], 0
        for microbatch, local, rows_NlD, mine in inputs:
            received += sum(arrival.buffer_ND.nbytes for arrival in mine)
            spans, spans_B2 = self._answer_spans(batch, microbatch)
            with compute_context(self.config):
                held = heldout_microbatch(
                    self.model, local, rows_NlD, spans_B2, heldout_target_tokens=batch.global_target_tokens
                )
            results.append((microbatch, spans, held))
        return results, received

    def _pipelined_held_out(self, batch: pb.StepCommand, count: int, inputs) -> tuple[list, int]:
        """`_held_out` through the pipeline: the last stage's ranks have the results."""
        taken, results = Taken(inputs, count), []

        def logits(m: int, logits_BSV: torch.Tensor) -> None:
            microbatch, local, _, _ = taken.items[m]
            spans, spans_B2 = self._answer_spans(batch, microbatch)
            held: HeldOut = held_out(self.model, logits_BSV, local, spans_B2,
                                     heldout_target_tokens=batch.global_target_tokens)
            results.append((microbatch, spans, held))

        work = StageHeldOut(self.model, self.layout, self.groups.index("pp"), taken, device=self.device,
                            held_out=logits, compute=lambda: compute_context(self.config))
        actions = forward_only(self.layout.pp, self.groups.index("pp"), count, self.layout.pp_virtual)
        self.pipeline.run(actions, work, count)
        received = sum(arrival.buffer_ND.nbytes for _, _, _, mine in taken.items for arrival in mine)
        return results, received

    def _answer_spans(self, batch: pb.StepCommand, microbatch: pb.Microbatch) -> tuple[list, torch.Tensor]:
        image_tokens = planned_image_tokens(batch.plan, microbatch.index)
        spans = [
            answer_targets(self.dataset.tokenizer, self.dataset.sample(s), image_tokens)
            for s in microbatch.sample_ids
        ]
        return spans, torch.tensor([[span.start, span.stop] for span in spans], device=self.device)

    def _microbatches_of_this_lane(self, command: pb.StepCommand) -> list[pb.Microbatch]:
        dp_rank = self.groups.index("dp")
        return [microbatch for microbatch in command.microbatches if microbatch.llm_dp_rank == dp_rank]

    def _inputs(self, command: pb.StepCommand, ours: list[pb.Microbatch], arrivals, waits: ExposedWait):
        """For each of `ours`: (the microbatch, this rank's shard of it on the device, its image
        rows as they arrived (None: it has no images), their arrivals)."""
        local_rows = {r.microbatch: r.rows for r in command.plan.local_rows if r.llm_rank == self.rank}
        for microbatch in ours:
            samples = [self.dataset.sample(s) for s in microbatch.sample_ids]
            batch = collate(self.dataset.tokenizer, samples, planned_image_tokens(command.plan, microbatch.index),
                            microbatch.row_sizes)
            local = shard_microbatch(  # on the CPU: no index work waits for the GPU
                batch,
                pad_id=self.dataset.tokenizer.pad_id,
                cp=self.layout.cp,
                cp_rank=self.groups.index("cp"),
                tp=self.layout.tp,
                multimodal_rope=self.config.llm.multimodal_rope,
            )
            expected = local.image_rows_Nl.numel() if self.splices else 0
            local = local.to(self.device)
            if local_rows.get(microbatch.index, 0) != expected:
                raise RuntimeError(
                    f"step {command.step} microbatch {microbatch.index}: the plan delivers "
                    f"{local_rows.get(microbatch.index, 0)} image rows here, this shard splices {expected}"
                )
            mine = arrivals.get(microbatch.index, [])
            with waits.measuring():
                rows_NlD = self._splice_rows(command, expected, mine) if batch.image_ids and self.splices else None
            yield microbatch, local, rows_NlD, mine

    def _post_receives(self, command: pb.StepCommand, phase: Phase) -> dict[int, list]:
        """Every transfer to this rank, receiving into its packed buffer, by microbatch."""
        arrivals: dict[int, list] = {}
        dtype = boundary_dtype(self.config)
        for transfer in command.plan.transfers:
            if transfer.dst_rank != self.rank:
                continue
            peer = self.peers[(pb.POOL_ENCODER, transfer.src_rank)]
            tag = MessageTag(
                self.message_space, command.step, transfer.microbatch, Direction.FORWARD, transfer.src_rank, phase
            )
            buffer_ND = torch.empty((transfer.rows, command.plan.hidden), dtype=dtype, device=self.device)
            arrival = Arrival(transfer, transfer_segments(transfer, self.device), buffer_ND,
                              self.transport.recv(peer, tag, buffer_ND))
            arrivals.setdefault(transfer.microbatch, []).append(arrival)
        return arrivals

    def _splice_rows(self, command: pb.StepCommand, rows: int, arrivals) -> torch.Tensor:
        """This shard's image rows, unpacked from every peer's buffer on tp rank 0 and broadcast
        to its tp group, as a leaf that collects their gradient (unless the encoder is frozen)."""
        rows_NlD = torch.empty((rows, command.plan.hidden), dtype=boundary_dtype(self.config), device=self.device)
        for arrival in arrivals:
            arrival.received.result()
            unpack_into(arrival.buffer_ND, rows_NlD, arrival.segments)
        if self.layout.tp > 1:
            dist.broadcast(rows_NlD, src=self.groups.ranks("tp")[0], group=self.groups.group("tp"))
        return rows_NlD.requires_grad_("encoder" not in self.config.train.freeze)

    def _send_gradients(self, step, arrivals, grad_NlD: torch.Tensor) -> list[tuple[Future, int]]:
        sends = []
        for arrival in arrivals:  # only tp rank 0 has any
            transfer = arrival.transfer
            peer = self.peers[(pb.POOL_ENCODER, transfer.src_rank)]
            tag = MessageTag(self.message_space, step, transfer.microbatch, Direction.BACKWARD, self.rank)
            buffer_ND = pack(grad_NlD, arrival.segments.reversed())
            sends.append((self.transport.send(peer, tag, buffer_ND), buffer_ND.nbytes))
        return sends


def planned_image_tokens(plan: pb.BoundaryPlan, microbatch: int) -> ImageTokens:
    """Each image of `microbatch`'s tokens and their grid, as the plan's encoder work gives them."""
    return PlannedTokens([work for work in plan.encoder_work if work.microbatch == microbatch])


class PlannedTokens:
    """`ImageTokens` of the images of some encoder work (`pb.EncoderWork`)."""

    def __init__(self, works: list[pb.EncoderWork]):
        self.tokens, self.grids = {}, {}
        for work in works:
            self.tokens.update(zip(work.image_ids, work.image_tokens, strict=True))
            if work.image_grids:
                grids = [tuple(work.image_grids[i : i + 3]) for i in range(0, len(work.image_grids), 3)]
                self.grids.update(zip(work.image_ids, grids, strict=True))

    def __call__(self, image_id: int) -> int:
        return self.tokens[image_id]

    def token_grid(self, image_id: int) -> tuple[int, int, int] | None:
        return self.grids.get(image_id)
