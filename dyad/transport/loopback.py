"""In-process twin of the UCX transport for tests: same matching rules, no sockets.

Instances find each other through a process-wide registry keyed by address. A send waits in
the receiver's mailbox until a recv with the same tag is posted (and vice versa); the bytes are
copied from the sender's tensor into the receiver's buffer at that moment and only then does
the send complete, as a rendezvous UCX send would. The twin is stricter than UCX on purpose:
- code that waits for its own send before posting the matching recv on the other side
  deadlocks here, as it does on UCX once messages are large;
- a message whose sender differs from the recv's `peer` fails the recv (UCX would accept it);
- closing is abortive as on UCX: the closing side's undelivered sends are dropped, and recvs
  elsewhere that wait on it fail with ConnectionError;
- admission (`authorize`) is checked on every send and recv, not once per connection: a send
  or recv toward `peer` fails with ConnectionError unless `peer` admits this transport (same
  secret, our address in its peer set), and `peer` logs the refusal as UCX does.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import threading
from collections import defaultdict, deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from dyad.transport.base import (
    Grant,
    MessageTag,
    Transport,
    TransportError,
    check_tensor,
    completed,
    refusal,
    size_mismatch,
)

logger = logging.getLogger(__name__)

_lock = threading.Lock()  # guards the registry and every mailbox
_registry: dict[str, LoopbackTransport] = {}
_next_id = itertools.count()


@dataclass
class _Send:
    source: str
    tag: MessageTag
    tensor: torch.Tensor
    future: Future = field(default_factory=Future)


@dataclass
class _Recv:
    peer: str
    tag: MessageTag
    out: torch.Tensor
    future: Future = field(default_factory=Future)
    timer: threading.Timer | None = None

    def fail(self, error: Exception) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.future.set_exception(error)


def _deliver(send: _Send, recv: _Recv) -> None:
    if send.source != recv.peer:
        recv.fail(TransportError(f"{recv.tag} came from {send.source}, recv expected {recv.peer}"))
    elif send.tensor.nbytes != recv.out.nbytes:
        recv.fail(size_mismatch(recv.tag, recv.peer, recv.out.nbytes, send.tensor.nbytes))
    else:
        if recv.timer is not None:
            recv.timer.cancel()
        recv.out.detach().view(-1).view(torch.uint8).copy_(send.tensor.view(-1).view(torch.uint8))
        recv.future.set_result(recv.out)
    send.future.set_result(None)  # UCX completes a send even when the receiver rejects it


def _take(queues: dict[int, deque], keep) -> list:
    """Remove and return the queued items for which `keep` is false."""
    taken = []
    for key, queue in queues.items():
        taken += [item for item in queue if not keep(item)]
        queues[key] = deque(item for item in queue if keep(item))
    return taken


class LoopbackTransport(Transport):
    def __init__(self):
        self.address = f"loopback:{next(_next_id)}"
        self._sends: dict[int, deque[_Send]] = defaultdict(deque)  # unmatched, by packed tag
        self._recvs: dict[int, deque[_Recv]] = defaultdict(deque)
        self._closed = False
        self._grant: Grant | None = None
        with _lock:
            _registry[self.address] = self

    def send(self, peer: str, tag: MessageTag, tensor: torch.Tensor) -> Future[None]:
        check_tensor("sent", tensor)
        key = tag.pack()
        self._check_open()
        if tensor.numel() == 0:
            return completed()
        send = _Send(self.address, tag, tensor.detach())
        with _lock:
            try:
                receiver = self._reach(peer)
            except ConnectionError as error:
                send.future.set_exception(error)
                return send.future
            recv = receiver._recvs[key].popleft() if receiver._recvs[key] else None
            if recv is None:
                receiver._sends[key].append(send)
        if recv is not None:
            _deliver(send, recv)
        return send.future

    def recv(
        self, peer: str, tag: MessageTag, out: torch.Tensor, timeout: float | None = None
    ) -> Future[torch.Tensor]:
        check_tensor("receive", out)
        key = tag.pack()
        self._check_open()
        if out.numel() == 0:
            return completed(out)
        recv = _Recv(peer, tag, out)
        with _lock:
            try:
                self._reach(peer)
            except ConnectionError as error:
                recv.fail(error)
                return recv.future
            send = self._sends[key].popleft() if self._sends[key] else None
            if send is None:
                self._recvs[key].append(recv)
                if timeout is not None:
                    recv.timer = threading.Timer(timeout, self._expire, (key, recv, timeout))
                    recv.timer.daemon = True
                    recv.timer.start()
        if send is not None:
            _deliver(send, recv)
        return recv.future

    def authorize(self, secret: bytes, peers: Iterable[str]) -> None:
        self._grant = Grant.of(secret, peers)

    def close(self) -> None:
        with _lock:
            if self._closed:
                return
            self._closed = True
            del _registry[self.address]
            undelivered_to_me = _take(self._sends, keep=lambda send: False)
            my_recvs = _take(self._recvs, keep=lambda recv: False)
            my_undelivered, waiting_on_me = [], []
            for other in _registry.values():
                my_undelivered += _take(other._sends, keep=lambda s: s.source != self.address)
                waiting_on_me += _take(other._recvs, keep=lambda r: r.peer != self.address)
        for send in undelivered_to_me:
            send.future.set_exception(ConnectionError(f"{self.address} closed before receiving"))
        for send in my_undelivered:
            send.future.set_exception(TransportError(f"{self.address} closed, {send.tag} dropped"))
        for recv in my_recvs:
            recv.fail(TransportError(f"transport {self.address} closed during recv of {recv.tag}"))
        for recv in waiting_on_me:
            recv.fail(ConnectionError(f"recv of {recv.tag} failed: {self.address} closed"))

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.address} is closed")
        if self._grant is None:
            raise TransportError(f"transport {self.address} is not authorized: call authorize()")

    def _reach(self, peer: str) -> LoopbackTransport:
        """The transport at `peer`, if it admits us (else it logs why not). Holds `_lock`."""
        other = _registry.get(peer)
        if other is None:
            raise ConnectionError(f"no loopback transport at {peer}")
        mine = self._grant.secret
        reason = refusal(
            other._grant, self.address, proves=lambda secret: hmac.compare_digest(secret, mine)
        )
        if reason is not None:
            logger.warning(
                "%s: refused loopback connection from %s: %s", peer, self.address, reason
            )
            raise ConnectionError(f"loopback peer {peer} refused {self.address}")
        return other

    def _expire(self, key: int, recv: _Recv, timeout: float) -> None:
        with _lock:
            try:
                self._recvs[key].remove(recv)
            except ValueError:
                return  # matched (or closed) in the meantime
        recv.future.set_exception(
            TimeoutError(f"recv of {recv.tag} from {recv.peer} timed out after {timeout}s")
        )
