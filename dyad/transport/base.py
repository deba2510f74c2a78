"""The data plane's contract: tagged, size-checked tensor messages between workers.

A transport moves the bytes of one contiguous tensor from a sender to a receiver that has
already allocated the destination (its shape and dtype come from the control plane). Calls
return `concurrent.futures.Future`s so synchronous training loops can start several transfers
and wait later.

Semantics every transport keeps (the loopback twin enforces them strictly):
- Matching is by tag only, per receiver (UCX matches per worker, not per connection), so a
  tag must be unique among everything in flight to one receiver: `MessageTag.peer` is what
  tells two senders apart. The twin also fails a recv whose message came from another peer.
- A send completes when the tensor may be reused (no copy is made on the way out, so it must
  not change before). It does not prove delivery: only the receiver's recv does.
- Closing is abortive, as UCX closes endpoints in force mode: a sender's undelivered messages
  are lost and recvs waiting on it fail with ConnectionError. Confirm through the control
  plane that receivers got everything before closing a sender.
- The receiver's buffer size is authoritative: a message of any other size fails the recv with
  `MessageSizeError`, never a silently truncated or half-filled buffer.
- Empty tensors complete at once on both sides without touching the wire.
- Only peers of the current plan get in: a transport talks to nobody until `authorize` gives it
  the run's secret and the plan's peer addresses, and refuses (logging a warning that says
  "refused", the claimed address and why) every peer that does not prove the same secret or
  is not in its set. The refused side's operation fails with ConnectionError.
"""

from __future__ import annotations

import functools
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import IntEnum

import torch

# 64-bit tag layout, most significant first. Bit 63 is left to the transport (it marks the
# size header that travels beside each payload), so `pack()` never sets it.
_RUN_BITS, _PHASE_BITS, _STEP_BITS, _MICROBATCH_BITS, _DIRECTION_BITS, _PEER_BITS = 14, 1, 24, 12, 1, 11
TRANSPORT_BIT = 1 << 63


class Direction(IntEnum):
    FORWARD = 0  # encoder activations, encoder -> LLM
    BACKWARD = 1  # their gradients, LLM -> encoder


class Phase(IntEnum):
    TRAIN = 0  # a training step's messages: `step` is the step
    EVAL = 1  # an evaluation's: `step` is the held-out batch


@dataclass(frozen=True)
class MessageTag:
    run: str
    step: int
    microbatch: int
    direction: Direction
    peer: int  # index of the sending/receiving pair, e.g. the source rank
    phase: Phase = Phase.TRAIN

    def pack(self) -> int:
        """The 64-bit UCX tag: run hash | phase | step | microbatch | direction | peer."""
        tag = _run_hash(self.run)
        for name, bits in (
            ("phase", _PHASE_BITS),
            ("step", _STEP_BITS),
            ("microbatch", _MICROBATCH_BITS),
            ("direction", _DIRECTION_BITS),
            ("peer", _PEER_BITS),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < (1 << bits):
                raise ValueError(f"MessageTag.{name} ({value!r}) does not fit in {bits} bits")
            tag = (tag << bits) | value
        return tag


@functools.lru_cache(maxsize=64)
def _run_hash(run: str) -> int:
    return zlib.crc32(run.encode()) & ((1 << _RUN_BITS) - 1)


class TransportError(RuntimeError):
    """The data plane broke a promise: transport closed, message from the wrong peer."""


class MessageSizeError(TransportError):
    """A message's size differs from the receiver's buffer: the two sides disagree on a plan."""


def size_mismatch(tag: MessageTag, peer: str, expected: int, sent: int) -> MessageSizeError:
    return MessageSizeError(
        f"recv of {tag} from {peer}: buffer holds {expected} bytes, sender sent {sent}"
    )


_MIN_SECRET_BYTES = 16


@dataclass(frozen=True)
class Grant:
    """What `authorize` gave a transport: the run's secret and the plan's peer addresses."""

    secret: bytes
    peers: frozenset[str]

    @classmethod
    def of(cls, secret: bytes, peers: Iterable[str]) -> Grant:
        if len(secret) < _MIN_SECRET_BYTES:  # the length only: a secret never goes in a message
            raise ValueError(
                f"run secret must be at least {_MIN_SECRET_BYTES} bytes, got {len(secret)}"
            )
        return cls(bytes(secret), frozenset(peers))


def refusal(grant: Grant | None, peer: str, proves: Callable[[bytes], bool]) -> str | None:
    """Why a transport holding `grant` refuses `peer`, or None to admit it; `proves(secret)`
    says whether the peer showed it holds `secret` (compared in constant time)."""
    if grant is None:
        return "not authorized yet"
    if not proves(grant.secret):
        return "bad run secret"
    if peer not in grant.peers:
        return "not a peer of the current plan"
    return None


def check_tensor(what: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{what} tensor must be contiguous (call .contiguous() first)")


def completed(value=None) -> Future:
    future = Future()
    future.set_result(value)
    return future


class Transport(ABC):
    """Point-to-point tensor messages between workers addressed by "host:port"."""

    address: str  # what peers pass as `peer` to reach this transport

    @abstractmethod
    def send(self, peer: str, tag: MessageTag, tensor: torch.Tensor) -> Future[None]:
        """Send the bytes of contiguous `tensor` to `peer`; completes when it may be reused."""

    @abstractmethod
    def recv(
        self, peer: str, tag: MessageTag, out: torch.Tensor, timeout: float | None = None
    ) -> Future[torch.Tensor]:
        """Receive the message tagged `tag` into contiguous `out` and return `out`.

        The future fails with `TimeoutError` after `timeout` seconds without a message, and
        with `MessageSizeError` when the message is not exactly `out.nbytes` long.
        """

    @abstractmethod
    def authorize(self, secret: bytes, peers: Iterable[str]) -> None:
        """Admit from now on only `peers` ("host:port", their own `address`es) that hold `secret`.

        Until the first call the transport refuses every peer, and its own `send`/`recv` raise
        `TransportError`. Calling again (a new generation of the run) replaces both for what
        connects after it; UCX keeps the endpoints it already admitted, the loopback twin (no
        connections) checks every message.
        """

    @abstractmethod
    def close(self) -> None:
        """Release connections; pending operations fail instead of hanging. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
