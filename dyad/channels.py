"""One way to open a channel to the router, for clients and workers alike: the message-size
limits of the wire contract, TLS when a CA is given, and the bearer token on every call."""

from __future__ import annotations

import collections
import os

import grpc

from dyad.credentials import read_file
from dyad.wire import GRPC_OPTIONS

TLS_ENV = {"tls_ca": "DYAD_TLS_CA", "tls_cert": "DYAD_TLS_CERT", "tls_key": "DYAD_TLS_KEY"}


def open_channel(
    address: str,
    *,
    token: str,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> grpc.Channel:
    """A channel to `address` whose calls carry `authorization: Bearer <token>`.

    TLS when `tls_ca` (or $DYAD_TLS_CA) is set, with a client certificate for mTLS when
    `tls_cert` and `tls_key` (or $DYAD_TLS_CERT, $DYAD_TLS_KEY) are; plaintext otherwise.
    """
    if not token:
        raise ValueError("token must be a non-empty string")
    tls_ca = tls_ca or os.environ.get(TLS_ENV["tls_ca"])
    tls_cert = tls_cert or os.environ.get(TLS_ENV["tls_cert"])
    tls_key = tls_key or os.environ.get(TLS_ENV["tls_key"])
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key must be given together (a client certificate)")
    if tls_cert and not tls_ca:
        raise ValueError("a client certificate (tls_cert) needs tls_ca: mTLS runs over TLS")
    if not tls_ca:
        # gRPC sends call credentials only over secure channels, so plaintext gets the header
        # from an interceptor.
        channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        return grpc.intercept_channel(channel, _BearerInterceptor(token))
    tls = grpc.ssl_channel_credentials(
        root_certificates=read_file(tls_ca, "TLS CA"),
        private_key=read_file(tls_key, "TLS key") if tls_key else None,
        certificate_chain=read_file(tls_cert, "TLS certificate") if tls_cert else None,
    )
    both = grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(address, both, options=GRPC_OPTIONS)


_CALL_FIELDS = ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")


class _CallDetails(collections.namedtuple("_CallDetails", _CALL_FIELDS), grpc.ClientCallDetails):
    pass


class _BearerInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(*(getattr(details, field) for field in _CALL_FIELDS))._replace(
            metadata=metadata
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)
