"""UCX transport over `ucxx`: one listener per worker, one outgoing endpoint per peer.

Threading: every ucxx call runs on one private asyncio loop in a background thread; the public
methods only validate, schedule the message there and hand back a `concurrent.futures.Future`.
A message to a connected peer whose buffer's kernels are done is posted in that one loop
callback and completed in another, without an asyncio task (`_InFlight`); connecting or
waiting for kernels goes through a task first. ucxx's own progress thread drives UCX, and its
notifier thread completes requests as asyncio futures (`enable_python_future=True`): the
default mode instead busy-polls `asyncio.sleep(0)` while any request is pending and would burn
a core beside the training loop.

Progress (`progress`, see `progress_mode`): where CUDA is present the progress thread polls
UCX ("thread-polling", a C++ thread that never takes the GIL but keeps one core busy), because
the sleeping one ("thread", waking from epoll at most every millisecond) delays every GPU
message (docs/performance.md, "Boundary transfer"); on CPU-only machines it sleeps.

Connections: each transport uses only the endpoint it opened itself, for sends and receives
alike (created on first use of a peer, shared by concurrent operations, forgotten when it
dies so a restarted peer can be reached again). UCX matches tags per worker, whichever
endpoint a message arrives on, so A's sends on A->B meet B's receives posted on B->A: two
workers connecting to each other at the same time never wait on each other and never need to
agree which connection is "the" one. Receives still go through our endpoint to the sender,
not the bare worker, because closing an endpoint (ours at `close()`, or the peer dying) cancels
the receives posted on it, while a worker-level receive can never be cancelled and would hang.

Handshake: each new endpoint starts with a challenge-response that admits only peers of the
current plan holding the run's secret (`authorize`); its fresh nonce makes a recorded one useless.
    accepting side:  32 random bytes (the nonce)
    connecting side: HMAC-SHA256(secret, label, nonce, its own address, the address it dialed)
                     followed by its own listening address, in one `send_obj`
    accepting side:  a 1-byte ack, once the MAC checks out, the address is one of its peers and
                     the endpoint is recorded under it (one per peer, kept until `close()`)
A refused peer gets no ack: its endpoint is closed, a warning saying "refused" is logged with
the address it claimed (or "an unidentified peer" where its answer never came or made no sense)
and the reason, at most once a minute for each (`_Refusals`), and the connecting side fails with
ConnectionError (at worst after `connect_timeout`). Bytes that are not UCX's own connection
request (e.g. random ones sent to the listening port) never reach this handshake: UCX drops them
below it, and no log line of ours can say so. The dialed
address is in the MAC so that a proof given to one listener cannot be relayed to another. The
handshake gates our endpoints, not UCX itself: tags match per worker, so a client speaking raw
UCX could still post tagged messages before it is refused. It keeps out workers of other plans
and runs; a hostile network needs isolation below UCX.

Wire format per message: an 8-byte size header under the tag with `TRANSPORT_BIT` set, and the
payload under `MessageTag.pack()`, both with `force_tag=True` so the exact 64-bit tag goes on
the wire. The header is there because UCX reports only the too-long case (truncation); a
too-short message would otherwise complete "successfully" into a half-written buffer.
"""

from __future__ import annotations

import array
import asyncio
import functools
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

# UCX reads UCX_MEMTYPE_CACHE when libucs loads, which importing ucxx does before ucxx sets it
# to "n": too late to act, and UCX then warns of an unused variable in every worker's log.
# Setting UCX's own default first keeps what UCX has always done here and silences the warning;
# a value the user set wins, and is read in time.
os.environ.setdefault("UCX_MEMTYPE_CACHE", "try")

import torch
from ucxx._lib.arr import Array
from ucxx._lib_async import ApplicationContext, Endpoint
from ucxx.exceptions import UCXError
from ucxx.types import Tag, TagMaskFull

from dyad.transport.base import (
    TRANSPORT_BIT,
    Grant,
    MessageTag,
    Transport,
    TransportError,
    check_tensor,
    completed,
    refusal,
    size_mismatch,
)
from dyad.ucx_progress import progress_mode

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 10.0
_NONCE_BYTES = 32
_MAC_BYTES = hashlib.sha256().digest_size
_MAX_ADDRESS_BYTES = 256  # bounds what a peer not yet proven can make us allocate
_MAC_LABEL = b"dyad-ucx-handshake-v1"
_REFUSALS_LOGGED_EVERY_S = 60.0  # per claimed address
_REFUSERS_KEPT = 1024  # claimed addresses remembered: whoever connects chooses what to claim
_UNIDENTIFIED = "an unidentified peer"


class UcxTransport(Transport):
    """Listens on all interfaces at `port` (0: any free one); `host` is what peers are told.

    On a cluster pass the worker's routable IP as `host`. A recv that times out (or whose
    future is cancelled) stays posted, as ucxx cannot cancel one request: its tag is burnt and
    `out` may still be written until the transport is closed, so treat it as a failed step.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        connect_timeout: float = 10.0,
        progress: str | None = None,
    ):
        self._engine = _Engine(connect_timeout, progress_mode(progress))
        self._close = weakref.finalize(self, self._engine.shutdown)
        try:
            self.address = f"{host}:{self._engine.call(self._engine.start(port))}"
        except BaseException:
            self._close()
            raise
        self._engine.address = self.address

    def send(self, peer: str, tag: MessageTag, tensor: torch.Tensor) -> Future[None]:
        message = self._message(peer, tag, tensor, "sent")
        if message is None:
            return completed()
        return self._engine.transfer(message, None, None)

    def recv(
        self, peer: str, tag: MessageTag, out: torch.Tensor, timeout: float | None = None
    ) -> Future[torch.Tensor]:
        message = self._message(peer, tag, out, "receive")
        if message is None:
            return completed(out)
        return self._engine.transfer(message, out, timeout)

    def authorize(self, secret: bytes, peers: Iterable[str]) -> None:
        self._engine.grant = Grant.of(secret, peers)  # swapped whole: the loop reads it as is

    def close(self) -> None:
        self._close()

    def _message(self, peer: str, tag: MessageTag, tensor: torch.Tensor, what: str):
        """Validate in the caller's thread (errors raise here, not in the future)."""
        check_tensor(what, tensor)
        key = tag.pack()
        host, _, port = peer.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"peer address must be 'host:port', got {peer!r}")
        if not self._close.alive:
            raise TransportError(f"transport {self.address} is closed")
        if self._engine.grant is None:
            raise TransportError(f"transport {self.address} is not authorized: call authorize()")
        if tensor.numel() == 0:
            return None  # both sides know the size: nothing goes on the wire
        sending = what == "sent"
        buffer, writes = _wire(tensor), _pending_writes(tensor)
        return _Message(peer, host, int(port), tag, key, sending, buffer, writes)


@dataclass(frozen=True)
class _Message:
    peer: str
    host: str
    port: int
    tag: MessageTag
    key: int  # tag.pack()
    sending: bool
    buffer: object  # the tensor's bytes, see _wire
    pending_writes: torch.cuda.Event | None


def _wire(tensor: torch.Tensor):
    """The tensor's bytes as something ucxx takes: bfloat16 has no numpy dtype, bytes do."""
    if tensor.is_cuda:
        return _DeviceBytes(tensor)
    return tensor.detach().view(-1).view(torch.uint8).numpy()


class _DeviceBytes:
    """A contiguous CUDA tensor's bytes as ucxx's `Array` reads them, through a prebuilt
    `__cuda_array_interface__`: torch builds that dict anew with its checks on every read, and
    the uint8 view it needs costs two more tensors, per message. Holds the tensor, so that its
    memory lives as long as the message does."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.nbytes = tensor, tensor.nbytes
        self.__cuda_array_interface__ = {
            "shape": (tensor.nbytes,),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


def _pending_writes(tensor: torch.Tensor) -> torch.cuda.Event | None:
    """UCX does not follow CUDA streams: mark the kernels queued so far on the caller's stream
    (recorded in the caller's thread, since the current stream is per thread)."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def _written_already(message: _Message) -> bool:
    return message.pending_writes is None or message.pending_writes.query()


async def _written(message: _Message) -> None:
    """Wait for the kernels `message.pending_writes` marks, off the loop (a thread hop)."""
    if not _written_already(message):
        await asyncio.to_thread(message.pending_writes.synchronize)


class _InFlight:
    """One message as two tagged requests, its size header and its payload, and what must
    live until UCX is done with them: the buffers (ucxx keeps raw pointers) and the requests
    (ucxx cancels one whose object is collected). `done` completes when both have, with their
    errors as values, and `on_done(self)` is called then.

    On a live endpoint the requests are posted on ucxx's Cython endpoint, as ucxx's own
    `Endpoint.send`/`recv` post them, without their coroutines: no asyncio task per request,
    since this per-message Python work, not the wire, bounds the messages a second
    (`bench/ucx_message_cost.py`). On a closed one they go through those coroutines, which
    fail a send and still receive what arrived before the endpoint closed."""

    def __init__(self, endpoint: Endpoint, message: _Message, out, result: Future, on_done):
        self.message, self.out, self.result = message, out, result
        self.header = array.array("Q", [message.buffer.nbytes if message.sending else 0])
        self.timer: asyncio.TimerHandle | None = None
        keys = (TRANSPORT_BIT | message.key, message.key)
        buffers = (self.header, message.buffer)
        if endpoint.closed:
            move = endpoint.send if message.sending else endpoint.recv
            work = [
                asyncio.ensure_future(move(buffer, tag=key, force_tag=True))
                for buffer, key in zip(buffers, keys)
            ]
            self.requests = ()
        else:
            core = endpoint._ep
            if message.sending:
                post = lambda b, k: core.tag_send(Array(b), Tag(k))  # noqa: E731
            else:
                post = lambda b, k: core.tag_recv(Array(b), Tag(k), TagMaskFull)  # noqa: E731
            self.requests = [post(b, k) for b, k in zip(buffers, keys)]
            work = [request.future for request in self.requests]
        # What asyncio.gather(*work, return_exceptions=True) would give, for a fraction of its
        # per-message cost, and `on_done` called at once rather than from another callback.
        self.outcomes: list = [None] * len(work)
        self.left, self.on_done = len(work), on_done
        self.done = asyncio.get_running_loop().create_future()
        for index, future in enumerate(work):
            future.add_done_callback(functools.partial(self._settled, index))

    def _settled(self, index: int, future: asyncio.Future) -> None:
        if future.cancelled():
            self.outcomes[index] = asyncio.CancelledError()
        else:
            self.outcomes[index] = future.exception() or future.result()
        self.left -= 1
        if self.left == 0 and not self.done.done():
            self.done.set_result(self.outcomes)
            self.on_done(self)

    def error(self) -> BaseException | None:
        """A size header that disagrees wins over the payload's own error: too long arrives
        as UCX truncation, too short silently."""
        header_error, payload_error = [r if isinstance(r, BaseException) else None for r in self.outcomes]
        if header_error is not None:
            return header_error
        expected, sent = self.message.buffer.nbytes, self.header[0]
        if not self.message.sending and sent != expected:
            return size_mismatch(self.message.tag, self.message.peer, expected, sent)
        return payload_error

    def time_out(self, timeout: float) -> None:
        if not self.result.done():
            what = _describe(self.message)
            self.result.set_exception(TimeoutError(f"{what} timed out after {timeout}s"))


def _describe(message: _Message) -> str:
    if message.sending:
        return f"send of {message.tag} to {message.peer}"
    return f"recv of {message.tag} from {message.peer}"


class _Engine:
    """Owns the loop thread and every ucxx object; its coroutines run on that loop only."""

    def __init__(self, connect_timeout: float, progress: str):
        self.connect_timeout = connect_timeout
        self.progress = progress
        self.address = "<starting>"
        self.grant: Grant | None = None
        self.closed = False
        self.ctx: ApplicationContext | None = None
        self.listener = None
        self.outgoing: dict[str, asyncio.Task[Endpoint]] = {}
        self.incoming: dict[str, Endpoint] = {}
        self.operations: set[asyncio.Future] = set()  # handshakes, messages connecting
        self.flights: set[_InFlight] = set()  # messages posted to UCX, with their buffers
        self.refusals = _Refusals()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dyad-ucx", daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float | None = None):
        """Run `coro` on the loop and wait for its result (setup and shutdown only)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start(self, port: int) -> int:
        # Created on the running loop: ucxx binds its progress and notifier to it.
        self.ctx = ApplicationContext(progress_mode=self.progress, enable_python_future=True)
        self.ctx.worker.populate_python_futures_pool()  # see _post
        try:
            self.listener = self.ctx.create_listener(
                self._accept, port=port, connect_timeout=self.connect_timeout
            )
        except UCXError as e:  # a port in use reads "Device is busy"
            raise OSError(f"UCX cannot listen on port {port}: {e!r}") from e
        return self.listener.port

    def transfer(self, message: _Message, out, timeout: float | None) -> Future:
        """From the caller's thread: the message starts on the loop and its future completes
        there. Once started it cannot be cancelled (UCX cannot take a request back)."""
        result = Future()
        try:
            self.loop.call_soon_threadsafe(self._begin, message, out, timeout, result)
        except RuntimeError:  # the loop is closed
            raise TransportError(f"transport {self.address} is closed") from None
        return result

    def _begin(self, message: _Message, out, timeout: float | None, result: Future) -> None:
        """Post at once where the peer is connected and the buffer's kernels are done (the
        common case: no asyncio task); otherwise connect and wait for them in a task first."""
        if not result.set_running_or_notify_cancel():
            return
        endpoint = None if self.closed else self._connected(message.peer)
        if endpoint is not None and _written_already(message):
            self._post(endpoint, message, out, timeout, result)
            return
        preparing = self._track(self._prepare(message))

        def prepared(done: asyncio.Future) -> None:
            if done.cancelled() or self.closed:
                result.set_exception(TransportError(f"transport {self.address} closed"))
            elif done.exception() is not None:
                result.set_exception(done.exception())
            else:
                self._post(done.result(), message, out, timeout, result)

        preparing.add_done_callback(prepared)

    async def _prepare(self, message: _Message) -> Endpoint:
        if self.closed:
            raise TransportError(f"transport {self.address} closed")
        endpoint = await self._endpoint(message)
        await _written(message)
        return endpoint

    def _post(self, endpoint: Endpoint, message: _Message, out, timeout, result: Future):
        """`result` completes when both requests have, or fails on `timeout` with them still
        posted: their buffers must live until UCX is done or the endpoint closes, so the
        operation stays tracked until then."""
        # Each request takes a Python future from a pool that ucxx's notifier thread refills
        # only when it wakes; a burst would drain it (ucxx then warns and refills inline).
        # The top-up is a no-op while the pool is over half full.
        self.ctx.worker.populate_python_futures_pool()
        try:
            flight = _InFlight(endpoint, message, out, result, functools.partial(self._finish, endpoint))
        except Exception as e:  # e.g. the endpoint closed under a request being posted
            result.set_exception(self._failure(e, message, endpoint))
            return
        self.flights.add(flight)
        if timeout is not None:
            flight.timer = self.loop.call_later(timeout, flight.time_out, timeout)

    def _finish(self, endpoint: Endpoint, flight: _InFlight) -> None:
        self.flights.discard(flight)
        if flight.timer is not None:
            flight.timer.cancel()
        if flight.result.done():  # timed out before
            return
        error = flight.error()
        if error is None:
            flight.result.set_result(flight.out)
        else:
            flight.result.set_exception(self._failure(error, flight.message, endpoint))

    def _failure(self, error: BaseException, message: _Message, endpoint) -> BaseException:
        """What the caller sees: TransportError once we are closing (ours closing cancels the
        requests), ConnectionError for UCX's errors (a dead endpoint is forgotten, so the
        next message reconnects: the peer restarted), any other error as it is."""
        if self.closed:
            return _caused(self._closed_during(message), error)
        if not isinstance(error, UCXError):
            return error
        if endpoint.closed:
            self._forget(message.peer, endpoint)
        return _caused(ConnectionError(f"{_describe(message)} failed: {error!r}"), error)

    def _closed_during(self, message: _Message) -> TransportError:
        return TransportError(f"transport {self.address} closed during {_describe(message)}")

    def _connected(self, peer: str) -> Endpoint | None:
        connecting = self.outgoing.get(peer)
        if connecting is None or not connecting.done() or _failed(connecting):
            return None
        return connecting.result()

    def _track(self, work) -> asyncio.Future:
        operation = asyncio.ensure_future(work)
        self.operations.add(operation)
        operation.add_done_callback(self._retire)
        return operation

    def _retire(self, operation: asyncio.Future) -> None:
        self.operations.discard(operation)
        if not operation.cancelled():
            operation.exception()  # retrieved here; callers that still wait re-raise it

    async def _endpoint(self, message: _Message) -> Endpoint:
        connecting = self.outgoing.get(message.peer)
        if connecting is None or _failed(connecting):
            connecting = asyncio.ensure_future(self._connect(message.host, message.port))
            self.outgoing[message.peer] = connecting
        return await asyncio.shield(connecting)  # one waiter giving up must not cancel the rest

    def _forget(self, peer: str, endpoint: Endpoint) -> None:
        """Drop a dead outgoing endpoint so the next operation reconnects (peer restarted)."""
        connecting = self.outgoing.get(peer)
        if connecting is not None and not _failed(connecting) and connecting.result() is endpoint:
            del self.outgoing[peer]

    async def _connect(self, host: str, port: int) -> Endpoint:
        """Connect, answer the peer's challenge, wait for its ack: after that neither side's
        setup is in progress, so closing the endpoint can never cut the peer's listener short
        (ucxx logs a traceback for a handler interrupted in its own peer-info exchange)."""
        peer = f"{host}:{port}"
        self.ctx.worker.populate_python_futures_pool()  # see _post
        try:
            endpoint = await self.ctx.create_endpoint(
                host, port, connect_timeout=self.connect_timeout
            )
        except (UCXError, OSError) as e:  # OSError: TimeoutError of ucxx's peer-info exchange
            raise ConnectionError(
                f"cannot reach UCX peer {peer} within {self.connect_timeout}s: {e!r}"
            ) from e
        try:
            handshake = self._track(self._answer(endpoint, peer, self.grant.secret))
            await asyncio.wait_for(asyncio.shield(handshake), self.connect_timeout)
        except (UCXError, OSError) as e:  # a refusal closes the endpoint: UCXError or timeout
            await endpoint.close()
            raise ConnectionError(
                f"UCX peer {peer} did not complete the handshake (it refuses addresses outside"
                f" its plan and other run secrets): {e!r}"
            ) from e
        return endpoint

    async def _answer(self, endpoint: Endpoint, peer: str, secret: bytes) -> None:
        nonce = bytearray(_NONCE_BYTES)
        await endpoint.recv(nonce)
        await endpoint.send_obj(_mac(secret, nonce, self.address, peer) + self.address.encode())
        await endpoint.recv(array.array("B", [0]))  # the ack

    async def _accept(self, endpoint: Endpoint) -> None:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        try:
            handshake = self._track(self._challenge(endpoint, nonce))
            answer = await asyncio.wait_for(asyncio.shield(handshake), self.connect_timeout)
        except Exception as e:  # a peer that died mid-handshake must not take us down
            if not self.closed:
                self.refusals(self.address, _UNIDENTIFIED, f"no valid handshake answer: {e!r}")
            await endpoint.close()
            return
        if self.closed:  # finished its handshake after close() collected the endpoints
            await endpoint.close()
            return
        mac, peer = bytes(answer[:_MAC_BYTES]), answer[_MAC_BYTES:].decode(errors="replace")
        reason = refusal(
            self.grant,
            peer,
            proves=lambda secret: hmac.compare_digest(mac, _mac(secret, nonce, peer, self.address)),
        )
        if reason is not None:
            self.refusals(self.address, _printable(peer), reason)
            await endpoint.close()
            return
        previous = self.incoming.pop(peer, None)
        self.incoming[peer] = endpoint  # known before the peer hears the ack
        if previous is not None:  # the peer restarted at the same address
            await previous.close()
        try:
            await endpoint.send(array.array("B", [1]))
        except UCXError as e:  # the peer is gone again; its recvs will fail on its side
            logger.warning("%s: could not ack %s: %r", self.address, peer, e)

    async def _challenge(self, endpoint: Endpoint, nonce: bytes) -> bytearray:
        await endpoint.send(nonce)
        return await endpoint.recv_obj(allocator=_answer_buffer)

    def shutdown(self) -> None:
        """Close endpoints and listener, fail pending work, stop the threads. Runs once."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.ctx is not None:
                self.call(self._close_all(), timeout=2 * _CLOSE_TIMEOUT_S)
        except Exception as e:
            logger.warning("%s: unclean UCX shutdown: %r", self.address, e)
        finally:
            if self.ctx is not None:
                # Wake the notifier thread from its 1 s wait, join it (the loop must still
                # run), then stop again: consuming the first stop re-arms the C++ notifier's
                # "running" state, which the worker's destructor would warn about.
                self.ctx.worker.stop_request_notifier_thread()
                self.ctx.stop_notifier_thread()
                self.ctx.worker.stop_request_notifier_thread()
                self.ctx.worker.stop_progress_thread()
            self.call(self._cancel_leftovers(), timeout=_CLOSE_TIMEOUT_S)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(_CLOSE_TIMEOUT_S)
            if not self.thread.is_alive():
                self.loop.close()
            self.ctx = self.listener = None

    async def _close_all(self) -> None:
        # Let handshakes in progress finish first: cut short, the peer's listener would log an
        # error for each. Half the budget for that, half for cancelled requests to settle.
        deadline = self.loop.time() + _CLOSE_TIMEOUT_S / 2
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()
            while listener.active_clients and self.loop.time() < deadline:
                await asyncio.sleep(0.01)
        connecting = [task for task in self.outgoing.values() if not task.done()]
        if connecting:
            await asyncio.wait(connecting, timeout=max(0.0, deadline - self.loop.time()))
        endpoints = list(self.incoming.values())
        for connecting in self.outgoing.values():
            if not connecting.done():
                connecting.cancel()
            elif not _failed(connecting):
                endpoints.append(connecting.result())
        self.outgoing.clear()
        self.incoming.clear()
        while endpoints:  # dropped one by one: their finalizers must run while UCX progresses
            await endpoints.pop().close()
        settling = {*self.operations, *(flight.done for flight in self.flights)}
        if settling:  # closing the endpoints cancelled their requests; let them settle
            await asyncio.wait(settling, timeout=_CLOSE_TIMEOUT_S / 2)

    async def _cancel_leftovers(self) -> None:
        """Whatever still waits is cancelled so that no caller's future hangs."""
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        for flight in self.flights:
            if not flight.result.done():
                flight.result.set_exception(self._closed_during(flight.message))


class _Refusals:
    """Refused connections, logged as warnings: an address's first refusal at once, then at most
    one line per `every_s` for it, counting those left out since. Called on the loop thread
    only. Past `kept` addresses (claimed by peers not proven, so chosen by whoever connects) new
    ones share one line, so that neither the table nor the log grows without bound."""

    def __init__(self, every_s: float = _REFUSALS_LOGGED_EVERY_S, kept: int = _REFUSERS_KEPT, clock=time.monotonic):
        self.every_s, self.kept, self.clock = every_s, kept, clock
        self._seen: dict[str, tuple[float, int]] = {}  # address -> (last logged, refusals left out since)

    def __call__(self, listener: str, peer: str, reason: str) -> None:
        if peer not in self._seen and len(self._seen) >= self.kept:
            peer = "other addresses"
        now = self.clock()
        logged, left_out = self._seen.get(peer, (None, 0))
        if logged is not None and now - logged < self.every_s:
            self._seen[peer] = (logged, left_out + 1)
            return
        self._seen[peer] = (now, 0)
        since = f" ({left_out} more refused since the last line for it)" if left_out else ""
        logger.warning("%s: refused UCX connection from %s: %s%s", listener, peer, reason, since)


def _mac(secret: bytes, nonce: bytes, connecting: str, listening: str) -> bytes:
    """The connecting side's proof, bound to one challenge and to both ends' addresses (the
    listener's as the connecting side dialed it: the address the plan lists for it)."""
    message = b"\0".join([_MAC_LABEL, nonce, connecting.encode(), listening.encode()])
    return hmac.new(secret, message, hashlib.sha256).digest()


def _answer_buffer(nbytes: int) -> bytearray:
    """`recv_obj`'s allocator for a handshake answer, whose size a peer not yet proven sets."""
    if not _MAC_BYTES < nbytes <= _MAC_BYTES + _MAX_ADDRESS_BYTES:
        raise ValueError(f"a handshake answer of {nbytes} bytes")
    return bytearray(nbytes)


def _printable(claimed: str) -> str:
    """A claimed address as it may go into a log line (an unproven peer chose it)."""
    return claimed if claimed.isprintable() else ascii(claimed)


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def _failed(task: asyncio.Future) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)
