"""The router answers only callers with the right token for the service (client token on
`Router`, join token on `Coordinator`), leaves health checks open, enforces the message-size
limit on its own side, and serves TLS and mTLS."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dyad.app.client import RouterClient
from dyad.channels import open_channel
from dyad.credentials import load_token
from dyad.router.auth import Credentials, server_credentials
from dyad.router.server import serve
from dyad.wire import GRPC_OPTIONS, MAX_MESSAGE_BYTES, pb, rpc

CREDENTIALS = Credentials(client_token="client-secret-123", join_token="join-secret-456")
UNKNOWN = "no-such-run"


@pytest.fixture(autouse=True)
def no_tls_environment(monkeypatch):
    for name in ("DYAD_TLS_CA", "DYAD_TLS_CERT", "DYAD_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def address():
    server, state = serve(host="127.0.0.1", port=0, credentials=CREDENTIALS)
    yield state.address
    server.stop(grace=None)


def _error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call(*args, **kwargs)
    return raised.value


def _get_run(channel: grpc.Channel):
    return rpc.RouterStub(channel).GetRun(pb.GetRunRequest(run_id=UNKNOWN), timeout=10)


def _watch(channel: grpc.Channel):
    return list(rpc.RouterStub(channel).WatchRun(pb.WatchRunRequest(run_id=UNKNOWN), timeout=10))


def _heartbeat(channel: grpc.Channel):
    request = pb.HeartbeatRequest(run_id=UNKNOWN, worker=pb.WorkerId(pool=pb.POOL_LLM))
    return rpc.CoordinatorStub(channel).Heartbeat(request, timeout=10)


def _commands(channel: grpc.Channel):
    request = pb.CommandStreamRequest(run_id=UNKNOWN, worker=pb.WorkerId(pool=pb.POOL_LLM))
    return list(rpc.CoordinatorStub(channel).Commands(request, timeout=10))


def _assert_refused(error: grpc.RpcError, token_name: str, problem: str) -> None:
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert token_name in error.details() and problem in error.details()
    for secret in (CREDENTIALS.client_token, CREDENTIALS.join_token):
        assert secret not in error.details()


@pytest.mark.parametrize("call", [_get_run, _watch], ids=["unary", "stream"])
def test_router_calls_without_a_token_are_unauthenticated(address, call):
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        _assert_refused(_error(call, channel), "client token (DYAD_TOKEN)", "missing")


@pytest.mark.parametrize("call", [_heartbeat, _commands], ids=["unary", "stream"])
def test_coordinator_calls_without_a_token_are_unauthenticated(address, call):
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        _assert_refused(_error(call, channel), "join token (DYAD_JOIN_TOKEN)", "missing")


@pytest.mark.parametrize("call", [_get_run, _watch], ids=["unary", "stream"])
def test_router_calls_with_a_wrong_token_are_unauthenticated(address, call):
    for token in ("not-the-token", CREDENTIALS.client_token + "x", CREDENTIALS.join_token):
        with open_channel(address, token=token) as channel:
            _assert_refused(_error(call, channel), "client token", "wrong")


@pytest.mark.parametrize("call", [_heartbeat, _commands], ids=["unary", "stream"])
def test_the_client_token_does_not_open_the_coordinator(address, call):
    with open_channel(address, token=CREDENTIALS.client_token) as channel:
        _assert_refused(_error(call, channel), "join token", "wrong")


def test_the_right_tokens_reach_the_handlers(address):
    with open_channel(address, token=CREDENTIALS.client_token) as channel:
        for call in (_get_run, _watch):
            error = _error(call, channel)
            assert error.code() == grpc.StatusCode.NOT_FOUND and UNKNOWN in error.details()
    with open_channel(address, token=CREDENTIALS.join_token) as channel:
        for call in (_heartbeat, _commands):
            error = _error(call, channel)
            assert error.code() == grpc.StatusCode.NOT_FOUND and UNKNOWN in error.details()


def test_a_malformed_authorization_header_is_refused(address):
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = rpc.RouterStub(channel)
        for header in (CREDENTIALS.client_token, f"Basic {CREDENTIALS.client_token}", "Bearer"):
            error = _error(
                stub.GetRun, pb.GetRunRequest(run_id=UNKNOWN),
                metadata=[("authorization", header)], timeout=10,
            )
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, header
        reply = _error(
            stub.GetRun, pb.GetRunRequest(run_id=UNKNOWN),
            metadata=[("authorization", f"bearer {CREDENTIALS.client_token}")], timeout=10,
        )
        assert reply.code() == grpc.StatusCode.NOT_FOUND  # the scheme is case-insensitive


def test_health_needs_no_token(address):
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "dyad.v1.Router", "dyad.v1.Coordinator"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _oversized_start_run() -> pb.StartRunRequest:
    # Invalid on purpose: were the limit not enforced, the router would answer INVALID_ARGUMENT
    # instead of starting workers.
    padding = "#" * (5 * 1024 * 1024)
    return pb.StartRunRequest(config_yaml=f"{padding}\ntrain: {{lr: -1}}\n")


def test_the_router_refuses_an_oversized_message_and_keeps_serving(address):
    request = _oversized_start_run()
    assert request.ByteSize() > MAX_MESSAGE_BYTES
    # A sender without the client-side limit, so that the router's own limit is what refuses.
    raw = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
    stub = rpc.RouterStub(raw)
    metadata = [("authorization", f"Bearer {CREDENTIALS.client_token}")]
    error = _error(stub.StartRun, request, metadata=metadata, timeout=30)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Received message larger than max" in error.details()
    raw.close()
    with RouterClient(address, token=CREDENTIALS.client_token) as client:
        error = _error(client.start_run, request.config_yaml)  # refused before it is sent
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Sent message larger than max" in error.details()
        error = _error(client.get_run, UNKNOWN)
        assert error.code() == grpc.StatusCode.NOT_FOUND


def test_credentials_need_both_tokens():
    for field, kwargs in [
        ("client_token", dict(client_token="", join_token="j")),
        ("join_token", dict(client_token="c", join_token="")),
    ]:
        with pytest.raises(ValueError, match=field):
            Credentials(**kwargs)


def test_load_token_reads_a_file_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DYAD_TOKEN", "from-env")
    path = tmp_path / "token"
    path.write_text("  from-file\n")
    assert load_token("DYAD_TOKEN", str(path)) == "from-file"
    assert load_token("DYAD_TOKEN", None) == "from-env"
    with pytest.raises(ValueError, match="missing-token"):
        load_token("DYAD_TOKEN", str(tmp_path / "missing-token"))
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_token("DYAD_TOKEN", str(path))
    monkeypatch.delenv("DYAD_TOKEN")
    with pytest.raises(ValueError, match="--token-file.*DYAD_TOKEN"):
        load_token("DYAD_TOKEN", None)


def test_tls_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        open_channel("127.0.0.1:1", token="t", tls_ca="ca.pem", tls_cert="cert.pem")
    with pytest.raises(ValueError, match="tls_ca"):
        open_channel("127.0.0.1:1", token="t", tls_cert="cert.pem", tls_key="key.pem")
    with pytest.raises(ValueError, match="token"):
        open_channel("127.0.0.1:1", token="")
    with pytest.raises(ValueError, match="no-such-cert.pem"):
        server_credentials(str(tmp_path / "no-such-cert.pem"), str(tmp_path / "key.pem"))


# ---------------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    x509 = pytest.importorskip("cryptography.x509", reason="TLS tests need `cryptography`")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(name, issuer_name, issuer_key, *, ca=False, san=None, usage=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ))
        return cert, key

    ca_cert, ca_key = issue("ca", None, None, ca=True)
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    issue("server", ca_cert.subject, ca_key, san=san, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    issue("client", ca_cert.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return {name: str(folder / name) for name in
            ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def _tls_router(pki, *, client_ca: bool):
    tls = server_credentials(
        pki["server.pem"], pki["server.key"], pki["ca.pem"] if client_ca else None
    )
    return serve(host="127.0.0.1", port=0, credentials=CREDENTIALS, tls=tls)


def test_get_run_round_trip_over_tls(pki):
    server, state = _tls_router(pki, client_ca=False)
    try:
        with RouterClient(state.address, token=CREDENTIALS.client_token,
                          tls_ca=pki["ca.pem"]) as client:
            error = _error(client.get_run, UNKNOWN)
            assert error.code() == grpc.StatusCode.NOT_FOUND and UNKNOWN in error.details()
        with RouterClient(state.address, token="wrong", tls_ca=pki["ca.pem"]) as client:
            assert _error(client.get_run, UNKNOWN).code() == grpc.StatusCode.UNAUTHENTICATED
        with RouterClient(state.address, token=CREDENTIALS.client_token) as plaintext:
            assert _error(plaintext.get_run, UNKNOWN).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=None)


def test_mtls_needs_a_client_certificate(pki):
    server, state = _tls_router(pki, client_ca=True)
    try:
        with RouterClient(state.address, token=CREDENTIALS.client_token,
                          tls_ca=pki["ca.pem"]) as no_cert:
            assert _error(no_cert.get_run, UNKNOWN).code() == grpc.StatusCode.UNAVAILABLE
        with RouterClient(state.address, token=CREDENTIALS.client_token, tls_ca=pki["ca.pem"],
                          tls_cert=pki["client.pem"], tls_key=pki["client.key"]) as client:
            error = _error(client.get_run, UNKNOWN)
            assert error.code() == grpc.StatusCode.NOT_FOUND and UNKNOWN in error.details()
    finally:
        server.stop(grace=None)
