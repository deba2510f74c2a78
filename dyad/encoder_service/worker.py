"""The encoder pool's worker: encode the images the plan gives this rank's data-parallel group,
send tp rank 0 of each LLM shard exactly the rows the shard splices (packed into one buffer per
peer), receive each row's gradient exactly once, and run backward.

Tensor-parallel ranks of a group compute together; only the group's tp rank 0 talks to the LLM
(it sends the rows, places the returned gradients and broadcasts them to its group).

Works ahead by rounds: round k is the k-th microbatch of every LLM data-parallel lane, which the
lanes train on together (their expert all-to-alls span lanes). Every image of up to
`boundary.prefetch_depth` rounds is encoded and sent before the gradient of the oldest is
awaited, so the LLM finds its next input already there, and no lane can wait on rows that sit
behind a gradient another lane cannot produce yet.

An evaluation encodes and sends the held-out batches' images the same way, forward only; so does
a step of a frozen encoder (`train.freeze: [encoder]`), which gets no gradient back.

The model is dyad's fixed-resolution ViT with its projector (SigLIP, CLIP, LLaVA towers), or a
Qwen3-VL native-resolution tower (`encoder.native`), whose merger is its projector: `Tower` says
how each is built, loaded, parallelized and held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn

from dyad.encoder_service.config import EncoderConfig
from dyad.encoder_service.hf import encoder_sources, qwen3_vl_sources
from dyad.encoder_service.hf_config import image_processor
from dyad.encoder_service.model import VisionEncoder
from dyad.encoder_service.parallelize import parallelize_encoder, parallelize_qwen3_vl_vision
from dyad.encoder_service.qwen3_vl import Qwen3VLVision
from dyad.encoder_service.step import encode_rows
from dyad.exposed_wait import ExposedWait
from dyad.hf_checkpoint import HFCheckpoint
from dyad.kernels.boundary_pack import RowSegments, pack, unpack_add
from dyad.service import PoolService, boundary_dtype, compute_context, transfer_segments
from dyad.slices import load_pieces
from dyad.transport import Direction, MessageTag, Phase
from dyad.wire import pb


@dataclass(frozen=True)
class Tower:
    """A kind of encoder model, as the worker builds, loads, parallelizes and holds it."""

    model: Callable[[EncoderConfig], nn.Module]  # the single-device model
    sources: Callable  # (an HFCheckpoint, the encoder config) -> where its tensors lie (dyad.slices)
    parallelize: Callable  # (the model, the pool's groups) -> its GradientPlan
    projector: tuple[str, ...]  # its parameters that train under train.freeze "vision_tower"
    # Held whatever train.freeze says where the LLM does not read them (a gradient of zeros would
    # still decay their weights): Qwen3-VL's DeepStack mergers, with llm.deepstack_levels 0.
    unread: tuple[str, ...] = ()


VIT = Tower(VisionEncoder, encoder_sources, parallelize_encoder, projector=("proj_in.", "proj_out."))
QWEN3_VL = Tower(
    lambda encoder: Qwen3VLVision(encoder.native),
    lambda checkpoint, encoder: qwen3_vl_sources(checkpoint, encoder.native),
    parallelize_qwen3_vl_vision,
    projector=("merger.", "deepstack_mergers."),
    unread=("deepstack_mergers.",),
)


def tower(encoder: EncoderConfig) -> Tower:
    return VIT if encoder.native is None else QWEN3_VL


@dataclass
class InFlight:
    microbatch: int
    rows_RD: torch.Tensor  # this group's encoder output, still attached to the graph
    sent: list[Future] = field(default_factory=list)
    gradients: list[tuple[Future, RowSegments]] = field(default_factory=list)


class EncoderWorker(PoolService):
    pool = "encoder"

    @cached_property
    def image_processor(self):
        return image_processor(self.config.encoder)

    @staticmethod
    def single_device_model(config) -> nn.Module:
        return tower(config.encoder).model(config.encoder)

    @staticmethod
    def load_pretrained(model: nn.Module, config) -> None:
        """The `encoder.from_hf` tower's weights (a ViT's up to its feature layer, its projector
        keeping its drawn values unless a LLaVA's comes with it)."""
        if config.encoder.from_hf:
            sources = tower(config.encoder).sources(HFCheckpoint(config.encoder.from_hf), config.encoder)
            load_pieces(model, sources)

    @staticmethod
    def freeze(model: nn.Module, config) -> None:
        """train.freeze "encoder": every parameter; "vision_tower": all but the projector's; and
        the tower's `unread` parts where the LLM takes no DeepStack levels."""
        held, kind = config.train.freeze, tower(config.encoder)
        unread = () if config.llm.reads_deepstack else kind.unread
        for name, param in model.named_parameters():
            if ("encoder" in held or ("vision_tower" in held and not name.startswith(kind.projector))
                    or name.startswith(unread)):
                param.requires_grad_(False)

    @property
    def frozen(self) -> bool:
        """The whole pool is held: it encodes without autograd, and no gradient comes back."""
        return "encoder" in self.config.train.freeze

    def parallelize(self, model, groups):
        return tower(self.config.encoder).parallelize(model, groups)

    @property
    def talks_to_llm(self) -> bool:
        return self.groups.index("tp") == 0

    def step(self, command: pb.StepCommand) -> pb.StepResult:
        self.lr = command.lr
        self.model.train()
        if self.frozen:
            sent = self._encode_and_send_all(command, Phase.TRAIN)
            return pb.StepResult(step=command.step, boundary_bytes_sent=sent, peak_memory_gb=self.peak_memory_gb())
        dp_rank = self.groups.index("dp")
        round_of = _rounds(command)
        mine = [w for w in command.plan.encoder_work if w.encoder_dp_rank == dp_rank]
        todo = deque(sorted(mine, key=lambda w: (round_of[w.microbatch], w.microbatch)))
        in_flight: deque[InFlight] = deque()
        bytes_sent = bytes_received = 0
        waits = ExposedWait(self.device)
        depth = self.config.boundary.prefetch_depth
        while todo or in_flight:
            oldest_round = round_of[(in_flight[0] if in_flight else todo[0]).microbatch]
            while todo and round_of[todo[0].microbatch] < oldest_round + depth:
                flight = self._encode_and_send(command, todo.popleft())
                in_flight.append(flight)
                bytes_sent += sum(sent.nbytes for sent in flight.sent)
            oldest = in_flight.popleft()
            with waits.measuring():
                grad_RD, received = self._gradient(oldest)
            bytes_received += received
            if not todo and not in_flight:
                self.reduction.arm()  # the step's last backward: reduce buckets as it ends them
            oldest.rows_RD.backward(grad_RD)
        grad_sq_norm = self.finish_backward()
        return pb.StepResult(
            step=command.step,
            grad_sq_norm=grad_sq_norm,
            boundary_bytes_sent=bytes_sent,
            boundary_bytes_received=bytes_received,
            boundary_wait_s=waits.seconds(),
            peak_memory_gb=self.peak_memory_gb(),
        )

    def evaluate(self, command: pb.EvalCommand) -> pb.EvalResult:
        """Encode and send the held-out batches' images, forward only: no gradient comes back.
        Each batch's sends end before the next batch begins."""
        self.model.eval()
        sent = sum(self._encode_and_send_all(batch, Phase.EVAL) for batch in command.batches)
        return pb.EvalResult(step=command.step, boundary_bytes_sent=sent)

    @torch.no_grad()
    def _encode_and_send_all(self, command: pb.StepCommand, phase: Phase) -> int:
        """Every image of this group's work in `command`, encoded and sent without autograd (an
        evaluation's, or a frozen encoder's step); the bytes sent, once every send has ended."""
        round_of = _rounds(command)
        dp_rank = self.groups.index("dp")
        mine = [w for w in command.plan.encoder_work if w.encoder_dp_rank == dp_rank]
        flights = [
            self._encode_and_send(command, work, phase, gradients=False)
            for work in sorted(mine, key=lambda w: (round_of[w.microbatch], w.microbatch))
        ]
        sent = 0
        for flight in flights:
            for sending in flight.sent:
                sending.future.result()
                sent += sending.nbytes
        return sent

    def _encode_and_send(
        self, command: pb.StepCommand, work: pb.EncoderWork, phase: Phase = Phase.TRAIN, gradients: bool = True,
    ) -> InFlight:
        """Encode `work`'s images and send their rows; with `gradients`, post the receives of
        their gradients too."""
        with compute_context(self.config):
            rows_RD = encode_rows(self.model, self.dataset, work.image_ids, self.device, self.image_processor,
                                  deepstack=self.config.llm.reads_deepstack)
        rows_RD = rows_RD.to(boundary_dtype(self.config))
        if rows_RD.shape[0] != work.rows:
            raise RuntimeError(
                f"step {command.step} microbatch {work.microbatch}: encoded {rows_RD.shape[0]} rows, "
                f"the plan says {work.rows}"
            )
        flight = InFlight(microbatch=work.microbatch, rows_RD=rows_RD)
        if not self.talks_to_llm:
            return flight
        payload_RD = rows_RD.detach()
        for transfer in command.plan.transfers:
            if transfer.src_rank != self.rank or transfer.microbatch != work.microbatch:
                continue
            segments = transfer_segments(transfer, self.device)
            peer = self.peers[(pb.POOL_LLM, transfer.dst_rank)]
            tag = MessageTag(self.message_space, command.step, transfer.microbatch, Direction.FORWARD, self.rank, phase)
            buffer_ND = pack(payload_RD, segments)
            flight.sent.append(_Sent(self.transport.send(peer, tag, buffer_ND), buffer_ND.nbytes))
            if not gradients:
                continue
            back = MessageTag(
                self.message_space, command.step, transfer.microbatch, Direction.BACKWARD, transfer.dst_rank
            )
            received = self.transport.recv(peer, back, torch.empty_like(buffer_ND))
            flight.gradients.append((received, segments))
        return flight

    def _gradient(self, flight: InFlight) -> tuple[torch.Tensor, int]:
        """The rows' gradient (each row arrives exactly once) on every tp rank, and the bytes
        received for it."""
        grad_RD = torch.zeros_like(flight.rows_RD)
        received = 0
        for arrival, segments in flight.gradients:
            buffer_ND = arrival.result()
            unpack_add(buffer_ND, grad_RD, segments.reversed())
            received += buffer_ND.nbytes
        for sent in flight.sent:
            sent.future.result()
        if self.layout.tp > 1:
            dist.broadcast(grad_RD, src=self.groups.ranks("tp")[0], group=self.groups.group("tp"))
        return grad_RD, received


@dataclass
class _Sent:
    future: Future
    nbytes: int


def _rounds(command: pb.StepCommand) -> dict[int, int]:
    """Microbatch index -> its position within its LLM data-parallel lane."""
    seen: dict[int, int] = {}
    rounds = {}
    for microbatch in command.microbatches:
        rounds[microbatch.index] = seen.get(microbatch.llm_dp_rank, 0)
        seen[microbatch.llm_dp_rank] = rounds[microbatch.index] + 1
    return rounds
