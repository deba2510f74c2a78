"""Who may talk to the router: bearer tokens per service, and optional TLS (mTLS with a client CA).

Clients present the client token on every `dyad.v1.Router` call; workers present the separate
join token on every `dyad.v1.Coordinator` call, so a leaked worker environment cannot start or
stop runs. grpc.health.v1 stays open for probes.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import grpc

from dyad.credentials import CLIENT_TOKEN_ENV, JOIN_TOKEN_ENV, read_file
from dyad.wire import pb

_BEARER = "bearer "


@dataclass(frozen=True)
class Credentials:
    client_token: str
    join_token: str

    def __post_init__(self):
        for field in ("client_token", "join_token"):
            if not getattr(self, field):
                raise ValueError(f"Credentials.{field} must be a non-empty token")


def server_credentials(
    cert_file: str, key_file: str, client_ca_file: str | None = None
) -> grpc.ServerCredentials:
    """TLS for the router; with `client_ca_file`, clients must present a certificate it signed."""
    cert = read_file(cert_file, "TLS certificate")
    key_pair = (read_file(key_file, "TLS key"), cert)
    client_ca = read_file(client_ca_file, "TLS client CA") if client_ca_file else None
    return grpc.ssl_server_credentials(
        [key_pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _service_name(name: str) -> str:
    return pb.DESCRIPTOR.services_by_name[name].full_name


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses `Router` calls without the client token and `Coordinator` calls without the join
    token (`authorization: Bearer <token>` metadata); other services pass untouched."""

    def __init__(self, credentials: Credentials):
        # service -> (its token, how errors name that token)
        self._rules = {
            _service_name("Router"):
                (credentials.client_token.encode(), f"the client token ({CLIENT_TOKEN_ENV})"),
            _service_name("Coordinator"):
                (credentials.join_token.encode(), f"the join token ({JOIN_TOKEN_ENV})"),
        }

    def intercept_service(self, continuation, handler_call_details):
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if service not in self._rules:
            return continuation(handler_call_details)
        expected, token_name = self._rules[service]
        presented = _bearer_token(handler_call_details.invocation_metadata)
        if presented is not None and hmac.compare_digest(presented.encode(), expected):
            return continuation(handler_call_details)
        problem = "missing" if presented is None else "wrong"
        return _refusal(
            continuation(handler_call_details),
            f"{service} needs {token_name} as 'authorization: Bearer <token>' metadata; "
            f"the token is {problem}",
        )


def _bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.lower().startswith(_BEARER):
            return value[len(_BEARER):]
    return None


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler | None:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED; the request is
    never deserialized."""
    if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
        return None

    def refuse(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
