"""Connections the UCX listener refuses are logged, with the address the peer claimed (or "an
unidentified peer" where its answer made no sense) and the reason, at most once a minute per
address with a count of those left out. Bytes that are not UCX's own connection request (random
ones sent to the port) are dropped by UCX below the handshake: the listener survives them, and
no log line of ours can see them."""

from __future__ import annotations

import logging
import os
import socket

import pytest
import torch

from dyad.transport import Direction, MessageTag, UcxTransport, ucx

pytestmark = pytest.mark.timeout(120)

CONNECT_TIMEOUT_S = 2.0
SECRET = b"the run secret of these tests..."
CLAIMED = "10.9.8.7:6543"


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]


def test_refusals_are_logged_once_a_minute_per_address_with_a_count(caplog):
    caplog.set_level(logging.WARNING, logger="dyad.transport")
    clock = _Clock()
    refusals = ucx._Refusals(clock=clock, kept=2)
    for _ in range(3):
        refusals("127.0.0.1:4000", CLAIMED, "bad run secret")
    refusals("127.0.0.1:4000", "10.0.0.1:1", "not a peer of the current plan")
    clock.now += 61
    refusals("127.0.0.1:4000", CLAIMED, "bad run secret")
    refusals("127.0.0.1:4000", "10.0.0.2:2", "bad run secret")  # past `kept` addresses: one line for all
    refusals("127.0.0.1:4000", "10.0.0.3:3", "bad run secret")
    assert _warnings(caplog) == [
        f"127.0.0.1:4000: refused UCX connection from {CLAIMED}: bad run secret",
        "127.0.0.1:4000: refused UCX connection from 10.0.0.1:1: not a peer of the current plan",
        f"127.0.0.1:4000: refused UCX connection from {CLAIMED}: bad run secret (2 more refused since the last line for it)",
        "127.0.0.1:4000: refused UCX connection from other addresses: bad run secret",
    ]


def _tag():
    return MessageTag("run-a", 3, 0, Direction.FORWARD, 0)


def _answering(answer: bytes):
    """A connecting side's handshake that answers the listener's nonce with `answer`."""

    async def answer_with(endpoint, peer, secret):
        await endpoint.recv(bytearray(ucx._NONCE_BYTES))
        await endpoint.send_obj(answer)
        await endpoint.recv(bytearray(1))

    return answer_with


def test_random_bytes_at_the_ucx_listener_are_refused_and_logged_once_per_address(caplog):
    caplog.set_level(logging.WARNING, logger="dyad.transport")
    connect = {"connect_timeout": CONNECT_TIMEOUT_S}
    with UcxTransport(**connect) as a, UcxTransport(**connect) as b, UcxTransport(**connect) as stranger:
        a.authorize(SECRET, [b.address])
        b.authorize(SECRET, [a.address])
        stranger.authorize(os.urandom(32), [a.address])

        # Raw random bytes on the listening port: UCX drops them before our handshake.
        host, port = a.address.rsplit(":", 1)
        for _ in range(3):
            with socket.create_connection((host, int(port))) as raw:
                raw.sendall(os.urandom(4096))

        # A UCX peer answering the challenge with random bytes, claiming an address three times,
        # then with random bytes of no valid size.
        stranger._engine._answer = _answering(os.urandom(ucx._MAC_BYTES) + CLAIMED.encode())
        for _ in range(3):
            with pytest.raises(ConnectionError):
                stranger.send(a.address, _tag(), torch.ones(3)).result(CONNECT_TIMEOUT_S + 5)
        stranger._engine._answer = _answering(os.urandom(ucx._MAC_BYTES // 2))
        with pytest.raises(ConnectionError):
            stranger.send(a.address, _tag(), torch.ones(3)).result(CONNECT_TIMEOUT_S + 5)

        out = torch.zeros(3)  # the listener serves its peers all along
        receiving = a.recv(b.address, _tag(), out)
        b.send(a.address, _tag(), torch.arange(3.0)).result(10)
        assert torch.equal(receiving.result(10), torch.arange(3.0))

    logged = [m for m in _warnings(caplog) if m.startswith(f"{a.address}: refused")]
    assert logged == [
        f"{a.address}: refused UCX connection from {CLAIMED}: bad run secret",
        (f"{a.address}: refused UCX connection from an unidentified peer: no valid handshake answer: "
         f"ValueError('a handshake answer of {ucx._MAC_BYTES // 2} bytes')"),
    ], logged
