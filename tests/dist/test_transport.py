"""Transports: every behaviour on the loopback twin and on UCX, UCX also across two processes.

ucxx allows several contexts per process (one `ApplicationContext` per `UcxTransport`, each on
its own loop thread), so the UCX pair below runs in this process; `test_ucx_two_processes`
and `test_ucx_peer_death_fails_pending_recv` run the far end in a spawned process, as the
services do. Every transport here is authorized with one secret and its companions' addresses;
refusals are tested in test_transport_auth.py.
"""

import multiprocessing
import os
import socket
import time

import pytest
import torch

from dyad.transport import (
    Direction,
    LoopbackTransport,
    MessageSizeError,
    MessageTag,
    Phase,
    TransportError,
    UcxTransport,
)

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0  # the longest any future may take; nothing here should wait on a hang
SECRET = b"the run secret of these tests..."
SHAPES = [(0,), (0, 64), (3,), (17, 64), (2, 3, 5), (1024, 256)]
DTYPES = [torch.float32, torch.bfloat16]
TRANSPORTS = {"loopback": LoopbackTransport, "ucx": UcxTransport}


def _tag(microbatch=0, direction=Direction.FORWARD, peer=0, step=3):
    return MessageTag("run-a", step, microbatch, direction, peer)


def _random_bits(shape, dtype, seed=0):
    """Arbitrary bit patterns (NaN payloads, infinities, denormals) to prove bit-exactness."""
    generator = torch.Generator().manual_seed(seed)
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, dtype=ints, generator=generator).view(dtype)


def _same_bytes(x, y):
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(
        x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
    )


def _authorized(*transports):
    """Admit each other: what a worker does with the router's secret and its plan's peers."""
    addresses = [transport.address for transport in transports]
    for transport in transports:
        transport.authorize(SECRET, addresses)
    return transports


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=list(TRANSPORTS))
def kind(request):
    return TRANSPORTS[request.param]


@pytest.fixture
def pair(kind):
    with kind() as a, kind() as b:
        yield _authorized(a, b)


# --- MessageTag -----------------------------------------------------------------------------


def test_pack_is_stable_and_fits_63_bits():
    tag = MessageTag("run-a", step=5, microbatch=7, direction=Direction.BACKWARD, peer=9)
    # Golden value: encoder and LLM builds must agree on the layout bit for bit.
    assert tag.pack() == 0x722E_0000_0500_7809
    top = MessageTag("r", 2**24 - 1, 2**12 - 1, Direction.BACKWARD, 2**11 - 1, Phase.EVAL).pack()
    assert top < 2**63  # bit 63 belongs to the transport


@pytest.mark.parametrize(
    "field,value",
    [("step", 1), ("microbatch", 1), ("direction", Direction.BACKWARD), ("peer", 1), ("run", "b"), ("phase", Phase.EVAL)],
)
def test_pack_separates_every_field(field, value):
    base = dict(run="run-a", step=0, microbatch=0, direction=Direction.FORWARD, peer=0)
    assert MessageTag(**base).pack() != MessageTag(**{**base, field: value}).pack()


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("step", 2**24, "MessageTag.step (16777216) does not fit in 24 bits"),
        ("microbatch", 5000, "MessageTag.microbatch (5000) does not fit in 12 bits"),
        ("peer", 2048, "MessageTag.peer (2048) does not fit in 11 bits"),
        ("peer", -1, "MessageTag.peer (-1) does not fit in 11 bits"),
        ("direction", 2, "MessageTag.direction (2) does not fit in 1 bits"),
    ],
)
def test_pack_rejects_values_that_do_not_fit(field, value, message):
    fields = dict(run="run-a", step=0, microbatch=0, direction=Direction.FORWARD, peer=0)
    tag = MessageTag(**{**fields, field: value})
    with pytest.raises(ValueError) as error:
        tag.pack()
    assert str(error.value) == message


# --- both transports, in one process --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_bit_exact(pair, shape, dtype):
    a, b = pair
    sent = _random_bits(shape, dtype)
    expected = sent.clone()
    out = torch.full(shape, 7, dtype=dtype)
    sending = a.send(b.address, _tag(), sent)
    receiving = b.recv(a.address, _tag(), out)
    assert receiving.result(WAIT_S) is out
    assert sending.result(WAIT_S) is None
    assert _same_bytes(out, expected) and _same_bytes(sent, expected)
    if sent.numel() == 0:  # nothing went on the wire
        assert sending.done() and receiving.done()
    else:
        assert out.data_ptr() != sent.data_ptr()


def test_both_directions_at_first_contact(pair):
    """Encoder -> LLM activations and LLM -> encoder gradients, both connecting at once."""
    encoder, llm = pair
    activations = _random_bits((17, 64), torch.bfloat16, seed=1).requires_grad_()
    gradients = _random_bits((17, 64), torch.bfloat16, seed=2)
    got_activations = torch.empty(17, 64, dtype=torch.bfloat16)
    got_gradients = torch.empty(17, 64, dtype=torch.bfloat16)
    futures = [
        encoder.send(llm.address, _tag(direction=Direction.FORWARD), activations),
        llm.send(encoder.address, _tag(direction=Direction.BACKWARD), gradients),
        llm.recv(encoder.address, _tag(direction=Direction.FORWARD), got_activations),
        encoder.recv(llm.address, _tag(direction=Direction.BACKWARD), got_gradients),
    ]
    for future in futures:
        future.result(WAIT_S)
    assert _same_bytes(got_activations, activations.detach())
    assert _same_bytes(got_gradients, gradients)


def test_tags_match_regardless_of_order(pair):
    a, b = pair
    count = 8
    sent = [torch.full((256, 64), float(i)) for i in range(count)]  # 64 KiB: rendezvous on UCX
    outs = [torch.empty(256, 64) for _ in range(count)]
    early = [b.recv(a.address, _tag(i), outs[i]) for i in (5, 2)]  # posted before their sends
    sends = [a.send(b.address, _tag(i), sent[i]) for i in range(count)]
    late = [b.recv(a.address, _tag(i), outs[i]) for i in reversed(range(count)) if i not in (5, 2)]
    for future in early + late + sends:
        future.result(WAIT_S)
    for i in range(count):
        assert torch.equal(outs[i], sent[i]), f"microbatch {i} got another message"


def test_peer_field_tells_senders_apart(kind):
    """Matching is by tag per receiver: two sources need distinct `peer` fields."""
    with kind() as llm, kind() as encoder0, kind() as encoder1:
        _authorized(llm, encoder0, encoder1)
        outs = [torch.empty(5), torch.empty(5)]
        receiving = [
            llm.recv(encoder.address, _tag(peer=i), outs[i])
            for i, encoder in enumerate((encoder0, encoder1))
        ]
        encoder1.send(llm.address, _tag(peer=1), torch.ones(5)).result(WAIT_S)
        encoder0.send(llm.address, _tag(peer=0), torch.zeros(5)).result(WAIT_S)
        for future in receiving:
            future.result(WAIT_S)
        assert outs[0].eq(0).all() and outs[1].eq(1).all()


@pytest.mark.parametrize("sent_numel,out_numel", [(20, 10), (10, 20)], ids=["long", "short"])
def test_size_mismatch_fails_the_recv(pair, sent_numel, out_numel):
    a, b = pair
    receiving = b.recv(a.address, _tag(), torch.empty(out_numel))
    a.send(b.address, _tag(), torch.ones(sent_numel)).result(WAIT_S)
    expected = f"buffer holds {4 * out_numel} bytes, sender sent {4 * sent_numel}"
    with pytest.raises(MessageSizeError, match=expected):
        receiving.result(WAIT_S)


def test_recv_times_out(pair):
    a, b = pair
    with pytest.raises(TimeoutError, match=r"timed out after 0.2s"):
        b.recv(a.address, _tag(), torch.empty(3), timeout=0.2).result(WAIT_S)


def test_close_fails_pending_work_on_both_sides(pair):
    a, b = pair
    a.send(b.address, _tag(microbatch=1), torch.ones(3))
    b.recv(a.address, _tag(microbatch=1), torch.empty(3)).result(WAIT_S)  # UCX: connected
    mine = b.recv(a.address, _tag(), torch.empty(3))
    theirs = a.recv(b.address, _tag(), torch.empty(3))
    b.close()
    b.close()  # idempotent
    with pytest.raises(TransportError, match=f"{b.address} closed"):
        mine.result(WAIT_S)
    with pytest.raises(ConnectionError, match=b.address):
        theirs.result(WAIT_S)
    with pytest.raises(TransportError, match="closed"):
        b.send(a.address, _tag(), torch.ones(3))


def test_ucx_message_sent_before_its_sender_closed_is_still_received():
    """A small message goes eagerly: its send completes before the recv is posted (the twin,
    rendezvous only, would wait). Once the sender has closed, the receiver's endpoint to it is
    closed too, and the recv must still take the message waiting in its worker."""
    with UcxTransport() as a, UcxTransport() as b:
        _authorized(a, b)
        a.send(b.address, _tag(microbatch=1), torch.ones(3))
        b.recv(a.address, _tag(microbatch=1), torch.empty(3)).result(WAIT_S)  # connected
        sent = _random_bits((5,), torch.float32)
        a.send(b.address, _tag(microbatch=2), sent).result(WAIT_S)
        a.close()
        time.sleep(0.5)  # b's endpoint to a sees the close
        out = b.recv(a.address, _tag(microbatch=2), torch.empty(5)).result(WAIT_S)
        assert _same_bytes(out, sent)


def test_ucx_recv_posted_after_its_peer_closed_fails_at_once():
    with UcxTransport() as a, UcxTransport() as b:
        _authorized(a, b)
        a.send(b.address, _tag(microbatch=1), torch.ones(3))
        b.recv(a.address, _tag(microbatch=1), torch.empty(3)).result(WAIT_S)  # connected
        a.close()
        time.sleep(0.5)
        with pytest.raises(ConnectionError, match=a.address):
            b.recv(a.address, _tag(microbatch=2), torch.empty(5)).result(WAIT_S)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: UCX on GPU buffers and the wait for their kernels are not exercised",
)
def test_ucx_gpu_buffers_arrive_bit_exact_while_their_kernels_still_run():
    """Each sent buffer is written by a copy queued behind a long matmul, so it is posted while
    its kernels are pending: the transport must wait for them (UCX does not follow streams).
    Eight messages of each spec are in flight at once, both dtypes."""
    specs = [((1 << 20,), torch.float32), ((1024, 513), torch.bfloat16), ((3,), torch.float32)]
    busy = torch.randn(4096, 4096, device="cuda")
    with UcxTransport() as a, UcxTransport() as b:
        _authorized(a, b)
        for shape, dtype in specs:
            expected = [_random_bits(shape, dtype, seed=i).cuda() for i in range(8)]
            outs = [torch.full(shape, 7, dtype=dtype, device="cuda") for _ in expected]
            recvs = [b.recv(a.address, _tag(i), out) for i, out in enumerate(outs)]
            sent, sends = [], []
            for i, bits in enumerate(expected):
                buffer = torch.zeros_like(bits)
                for _ in range(4):
                    busy = busy @ busy / 64  # keeps the stream busy for milliseconds
                buffer.copy_(bits)
                sent.append(buffer)
                sends.append(a.send(b.address, _tag(i), buffer))
            for future in sends + recvs:
                future.result(WAIT_S)
            for i, out in enumerate(outs):
                assert _same_bytes(out, expected[i]), f"{shape} {dtype} message {i}"


def test_rejects_non_contiguous_tensors(pair):
    a, b = pair
    with pytest.raises(ValueError, match="contiguous"):
        a.send(b.address, _tag(), torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="contiguous"):
        b.recv(a.address, _tag(), torch.ones(4, 4)[:, :2])


def test_unreachable_peer_is_a_connection_error(kind):
    address = f"127.0.0.1:{_free_port()}"
    options = {"connect_timeout": 1.0} if kind is UcxTransport else {}
    with kind(**options) as transport:
        transport.authorize(SECRET, [address])
        with pytest.raises(ConnectionError, match=address):
            transport.send(address, _tag(), torch.ones(3)).result(WAIT_S)


def test_ucx_port_in_use_is_an_os_error():
    with UcxTransport() as transport:
        port = int(transport.address.rpartition(":")[2])
        with pytest.raises(OSError, match=f"cannot listen on port {port}"):
            UcxTransport(port=port)


def test_loopback_checks_the_sender():
    with LoopbackTransport() as a, LoopbackTransport() as b, LoopbackTransport() as c:
        _authorized(a, b, c)
        receiving = b.recv(a.address, _tag(), torch.empty(3))
        c.send(b.address, _tag(), torch.ones(3)).result(WAIT_S)
        with pytest.raises(TransportError, match=f"came from {c.address}"):
            receiving.result(WAIT_S)


# --- UCX across processes -------------------------------------------------------------------


def _echo_peer(conn):
    """Child process: receive each forward message, return it as the backward message."""
    with UcxTransport() as transport:
        conn.send(transport.address)
        peer, specs = conn.recv()
        transport.authorize(SECRET, [peer])
        for i, (shape, dtype) in enumerate(specs):
            buffer = torch.empty(shape, dtype=dtype)
            transport.recv(peer, _tag(i, Direction.FORWARD), buffer).result(WAIT_S)
            transport.send(peer, _tag(i, Direction.BACKWARD), buffer).result(WAIT_S)
        conn.recv()  # closing is abortive: stay until the parent has received everything


def _die_after_connecting(conn):
    """Child process: connect to the parent, then vanish without closing anything."""
    transport = UcxTransport()
    conn.send(transport.address)
    peer = conn.recv()
    transport.authorize(SECRET, [peer])
    transport.send(peer, _tag(microbatch=1), torch.ones(3)).result(WAIT_S)
    conn.send("connected")
    conn.recv()
    os._exit(0)


def _spawn(target):
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    process = context.Process(target=target, args=(child_conn,), daemon=True)
    process.start()
    return process, parent_conn


def _finish(process):
    process.join(WAIT_S)
    if process.is_alive():
        process.kill()
    return process.exitcode


def test_ucx_two_processes():
    specs = [(shape, dtype) for dtype in DTYPES for shape in SHAPES]
    process, conn = _spawn(_echo_peer)
    try:
        with UcxTransport() as transport:
            assert conn.poll(30), "child did not start"
            child = conn.recv()
            transport.authorize(SECRET, [child])
            conn.send((transport.address, specs))
            sent = [_random_bits(shape, dtype, seed=i) for i, (shape, dtype) in enumerate(specs)]
            outs = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
            futures = [
                transport.recv(child, _tag(i, Direction.BACKWARD), outs[i]) for i in range(len(specs))
            ]
            futures += [
                transport.send(child, _tag(i, Direction.FORWARD), sent[i]) for i in range(len(specs))
            ]
            for future in futures:
                future.result(WAIT_S)
            conn.send("received")
        for i, (shape, dtype) in enumerate(specs):
            assert _same_bytes(outs[i], sent[i]), f"{shape} {dtype}"
    finally:
        assert _finish(process) == 0


def test_ucx_peer_death_fails_pending_recv():
    process, conn = _spawn(_die_after_connecting)
    try:
        with UcxTransport() as transport:
            assert conn.poll(30), "child did not start"
            child = conn.recv()
            transport.authorize(SECRET, [child])
            conn.send(transport.address)
            assert conn.poll(WAIT_S), "child did not connect"
            assert conn.recv() == "connected"
            transport.recv(child, _tag(microbatch=1), torch.empty(3)).result(WAIT_S)
            pending = transport.recv(child, _tag(microbatch=2), torch.empty(3))
            conn.send("die")
            with pytest.raises(ConnectionError, match=child):
                pending.result(WAIT_S)
    finally:
        _finish(process)


@pytest.mark.parametrize("inherited", ["polling", "blocking"])
def test_ucx_ignores_an_inherited_progress_mode(monkeypatch, inherited):
    """UCXPY_PROGRESS_MODE would turn off the notifier thread that completes our futures."""
    monkeypatch.setenv("UCXPY_PROGRESS_MODE", inherited)
    with UcxTransport() as a, UcxTransport() as b:
        _authorized(a, b)
        sent, out = _random_bits((17, 64), torch.float32), torch.zeros(17, 64)
        sending = a.send(b.address, _tag(), sent)
        assert b.recv(a.address, _tag(), out).result(WAIT_S) is out
        assert sending.result(WAIT_S) is None and _same_bytes(out, sent)


def test_ucx_progress_mode_polls_only_where_cuda_is(monkeypatch):
    from dyad.ucx_progress import PROGRESS_ENV, progress_mode

    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert progress_mode() == "thread-polling"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert progress_mode() == "thread"
    monkeypatch.setenv(PROGRESS_ENV, "thread-polling")
    assert progress_mode() == "thread-polling"
    assert progress_mode("thread") == "thread"  # the argument wins over the environment


@pytest.mark.parametrize("asked,env,field", [("polling", None, "progress"), (None, "blocking", "DYAD_UCX_PROGRESS")])
def test_ucx_progress_mode_refuses_modes_without_the_notifier(monkeypatch, asked, env, field):
    from dyad.ucx_progress import PROGRESS_ENV

    if env is None:
        monkeypatch.delenv(PROGRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(PROGRESS_ENV, env)
    with pytest.raises(ValueError, match=f"{field} must be one of thread, thread-polling"):
        UcxTransport(progress=asked)


def test_ucx_polling_progress_moves_messages():
    with UcxTransport(progress="thread-polling") as a, UcxTransport(progress="thread-polling") as b:
        _authorized(a, b)
        sent, out = _random_bits((33, 16), torch.bfloat16), torch.zeros(33, 16, dtype=torch.bfloat16)
        sending = a.send(b.address, _tag(), sent)
        assert b.recv(a.address, _tag(), out).result(WAIT_S) is out
        assert sending.result(WAIT_S) is None and _same_bytes(out, sent)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"))],
)
def test_ucx_moves_slices_of_larger_tensors_and_leaves_their_neighbours_alone(device):
    """The transport hands UCX a buffer's own address (a view's storage offset included), so a
    slice sends exactly its bytes and a slice receives into exactly its bytes."""
    sent_from = _random_bits((4, 1000), torch.bfloat16, seed=1).to(device)
    lands_in = torch.full((6, 1000), 3, dtype=torch.bfloat16, device=device)
    with UcxTransport() as a, UcxTransport() as b:
        _authorized(a, b)
        recv = b.recv(a.address, _tag(), lands_in[2:5])
        a.send(b.address, _tag(), sent_from[1:4]).result(WAIT_S)
        recv.result(WAIT_S)
    assert _same_bytes(lands_in[2:5], sent_from[1:4])
    assert (lands_in[:2] == 3).all() and (lands_in[5:] == 3).all()
