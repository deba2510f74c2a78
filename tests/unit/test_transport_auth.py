"""Admission: transports let in only peers of the current plan that hold the run's secret.

Each refusal is checked on both sides: the refused operation fails with ConnectionError, and the
refusing transport logs a warning that says "refused", the claimed address and why.
"""

import array
import logging

import pytest
import torch

from dyad.transport import (
    Direction,
    LoopbackTransport,
    MessageTag,
    TransportError,
    UcxTransport,
    ucx,
)

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
CONNECT_TIMEOUT_S = 2.0  # a refused UCX connect must fail within this, never hang
SECRET = b"the run secret of these tests..."
OTHER_SECRET = b"the secret of some other run...."
TRANSPORTS = {"loopback": LoopbackTransport, "ucx": UcxTransport}


def _tag(microbatch=0):
    return MessageTag("run-a", 3, microbatch, Direction.FORWARD, 0)


@pytest.fixture(params=list(TRANSPORTS))
def make(request):
    """Builds transports of one kind, closed at the end of the test."""
    made = []

    def build():
        kind = TRANSPORTS[request.param]
        made.append(kind(connect_timeout=CONNECT_TIMEOUT_S) if kind is UcxTransport else kind())
        return made[-1]

    yield build
    for transport in made:
        transport.close()


@pytest.fixture
def refusals(caplog):
    """The refusal warnings logged so far."""
    caplog.set_level(logging.WARNING, logger="dyad.transport")
    return lambda: [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "refused" in r.getMessage()
    ]


def _delivers(sender, receiver, microbatch=0) -> bool:
    sent = torch.arange(6, dtype=torch.float32) + microbatch
    out = torch.zeros(6)
    receiving = receiver.recv(sender.address, _tag(microbatch), out)
    sender.send(receiver.address, _tag(microbatch), sent).result(WAIT_S)
    return receiving.result(WAIT_S) is out and torch.equal(out, sent)


def _assert_refused(sender, receiver, reason, refusals):
    with pytest.raises(ConnectionError, match=receiver.address):
        sender.send(receiver.address, _tag(), torch.ones(3)).result(CONNECT_TIMEOUT_S + 1)
    expected = f"{receiver.address}: refused"
    logged = [m for m in refusals() if m.startswith(expected) and sender.address in m]
    assert logged, refusals()
    assert all(m.endswith(f"from {sender.address}: {reason}") for m in logged), logged


def test_authorized_peers_exchange_a_tensor(make):
    a, b = make(), make()
    a.authorize(SECRET, [b.address])
    b.authorize(SECRET, [a.address])
    assert _delivers(a, b) and _delivers(b, a, microbatch=1)


def test_a_transport_outside_the_plan_is_refused(make, refusals):
    a, b, outsider = make(), make(), make()
    a.authorize(SECRET, [b.address])
    b.authorize(SECRET, [a.address])
    outsider.authorize(SECRET, [b.address])  # holds the secret, but b's plan does not list it
    _assert_refused(outsider, b, "not a peer of the current plan", refusals)
    assert _delivers(a, b)  # the plan's own peers are unaffected


def test_a_peer_with_another_secret_is_refused(make, refusals):
    a, b = make(), make()
    a.authorize(OTHER_SECRET, [b.address])
    b.authorize(SECRET, [a.address])
    _assert_refused(a, b, "bad run secret", refusals)


def test_a_transport_not_yet_authorized_refuses_everyone(make, refusals):
    a, b = make(), make()
    a.authorize(SECRET, [b.address])
    _assert_refused(a, b, "not authorized yet", refusals)


def test_a_transport_not_yet_authorized_cannot_send_or_recv(make):
    a, b = make(), make()
    with pytest.raises(TransportError, match=f"{a.address} is not authorized"):
        a.send(b.address, _tag(), torch.ones(3))
    with pytest.raises(TransportError, match=f"{a.address} is not authorized"):
        a.recv(b.address, _tag(), torch.empty(3))


def test_authorize_rejects_a_short_secret(make):
    with pytest.raises(ValueError, match="at least 16 bytes, got 5"):
        make().authorize(b"short", [])


def test_reauthorizing_admits_the_new_plan(make, refusals):
    a, b, newcomer = make(), make(), make()
    a.authorize(SECRET, [b.address])
    newcomer.authorize(SECRET, [b.address])
    b.authorize(SECRET, [a.address])
    _assert_refused(newcomer, b, "not a peer of the current plan", refusals)
    b.authorize(SECRET, [a.address, newcomer.address])  # the next generation's plan
    assert _delivers(newcomer, b)


def test_reauthorizing_with_a_new_secret_refuses_the_old_one(make, refusals):
    a, b = make(), make()
    a.authorize(SECRET, [b.address])
    b.authorize(OTHER_SECRET, [a.address])
    _assert_refused(a, b, "bad run secret", refusals)
    a.authorize(OTHER_SECRET, [b.address])
    assert _delivers(a, b)


def test_a_recorded_ucx_handshake_cannot_be_replayed(monkeypatch, refusals):
    """An eavesdropper replays a peer's answer, claiming its address, to a fresh challenge."""
    macs = {}  # (connecting, listening) -> the first MAC computed for that pair

    def recording_mac(secret, nonce, connecting, listening):
        mac = real_mac(secret, nonce, connecting, listening)
        macs.setdefault((connecting, listening), mac)
        return mac

    real_mac = ucx._mac
    monkeypatch.setattr(ucx, "_mac", recording_mac)
    connect = {"connect_timeout": CONNECT_TIMEOUT_S}
    with UcxTransport(**connect) as a, UcxTransport(**connect) as b, UcxTransport(**connect) as spy:
        a.authorize(SECRET, [b.address])
        b.authorize(SECRET, [a.address])
        spy.authorize(OTHER_SECRET, [b.address])
        assert _delivers(a, b)
        recorded = macs[a.address, b.address] + a.address.encode()  # a's answer to b

        async def replay(endpoint, peer, secret):
            await endpoint.recv(bytearray(ucx._NONCE_BYTES))
            await endpoint.send_obj(recorded)
            await endpoint.recv(array.array("B", [0]))

        spy._engine._answer = replay
        with pytest.raises(ConnectionError, match=b.address):
            spy.send(b.address, _tag(), torch.ones(3)).result(CONNECT_TIMEOUT_S + 1)
        assert f"{b.address}: refused UCX connection from {a.address}: bad run secret" in refusals()
        assert _delivers(a, b, microbatch=1)  # the real a keeps its endpoint
