"""The encoder works ahead: with `boundary.prefetch_depth` = d it sends the rows of up to d
rounds (microbatches, with one LLM lane) before it waits for the oldest one's gradient; d = 1
is lock-step.

A real encoder worker runs a step against the loopback transport. The LLM is played by a
second loopback transport that answers as late as it can: it takes a microbatch's rows and
returns their gradient only once the encoder blocks on that gradient. Everything happens on the
encoder's thread, so the recorded order of sends and gradient arrivals is deterministic.
"""

from __future__ import annotations

import dataclasses

import torch

from dyad import config as config_lib
from dyad.data import make_dataset
from dyad.encoder_service.worker import EncoderWorker
from dyad.router.steps import StepPlanner, step_command
from dyad.transport import Direction, LoopbackTransport, Transport
from dyad.wire import pb
from tests.helpers.distributed import run_distributed

MICROBATCHES = 3
SECRET = b"prefetch-test-secret"


class LateLLM(Transport):
    """The encoder's transport: loopback underneath; records ("rows", microbatch) at each send
    and ("gradient", microbatch) when a gradient arrives, which is when the encoder first
    waits for it: only then does the LLM side take the rows and send their gradient back."""

    def __init__(self):
        self._wire = LoopbackTransport()
        self.address = self._wire.address
        self.llm = LoopbackTransport()
        self.events: list[tuple[str, int]] = []

    def send(self, peer, tag, tensor):
        assert tag.direction == Direction.FORWARD
        self.events.append(("rows", tag.microbatch))
        return self._wire.send(peer, tag, tensor)

    def recv(self, peer, tag, out, timeout=None):
        assert tag.direction == Direction.BACKWARD
        arrival = self._wire.recv(peer, tag, out, timeout)
        wait = arrival.result

        def answer_then_wait(timeout=None):
            if not arrival.done():
                forward = dataclasses.replace(tag, direction=Direction.FORWARD, peer=0)  # encoder rank 0
                rows = self.llm.recv(self.address, forward, torch.empty_like(out)).result(timeout=10)
                self.llm.send(self.address, tag, torch.ones_like(rows)).result(timeout=10)
                self.events.append(("gradient", tag.microbatch))
            return wait(timeout)

        arrival.result = answer_then_wait
        return arrival

    def authorize(self, secret, peers):
        self._wire.authorize(secret, peers)

    def close(self):
        self._wire.close()
        self.llm.close()


def _run_step(config, command) -> tuple[list[tuple[str, int]], pb.StepResult]:
    transport = LateLLM()
    transport.llm.authorize(SECRET, {transport.address})
    worker = EncoderWorker(config, transport, rank=0, run_id="prefetch")
    worker.run_secret = SECRET
    worker.setup(pb.SetupCommand(generation=1, peers=[
        pb.Peer(worker=pb.WorkerId(pool=pb.POOL_ENCODER, rank=0), data_address=transport.address),
        pb.Peer(worker=pb.WorkerId(pool=pb.POOL_LLM, rank=0), data_address=transport.llm.address),
    ]))
    result = worker.step(command)
    transport.close()
    return transport.events, result


def _prefetch_orders(rank, world_size):
    config = config_lib.load(None, [f"train.microbatches={MICROBATCHES}", f"train.global_batch={MICROBATCHES}"])
    dataset = make_dataset(config.data)
    config = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    planner = StepPlanner(config, dataset)
    spec = planner.next(0)
    plan = planner.boundary_plan(spec)
    assert sorted({t.microbatch for t in plan.transfers}) == list(range(MICROBATCHES))
    command = step_command(spec, plan)

    rows = [("rows", k) for k in range(MICROBATCHES)]
    gradients = [("gradient", k) for k in range(MICROBATCHES)]
    expected = {
        1: [rows[0], gradients[0], rows[1], gradients[1], rows[2], gradients[2]],  # lock-step
        2: [rows[0], rows[1], gradients[0], rows[2], gradients[1], gradients[2]],
        3: [*rows, *gradients],
    }
    for depth, order in expected.items():
        events, result = _run_step(
            dataclasses.replace(config, boundary=dataclasses.replace(config.boundary, prefetch_depth=depth)),
            command,
        )
        assert events == order, f"prefetch_depth={depth}: {events}"
        assert result.boundary_bytes_sent == plan.bytes_forward
        assert result.boundary_bytes_received == plan.bytes_backward


def test_the_encoder_sends_ahead_as_deep_as_configured():
    run_distributed(_prefetch_orders, 1)
