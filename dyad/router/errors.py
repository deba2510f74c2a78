"""Errors the router answers with, and the one place they become gRPC status codes."""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

log = logging.getLogger(__name__)


class NotFound(LookupError):
    pass


class FailedPrecondition(RuntimeError):
    pass


class PermissionDenied(RuntimeError):
    """The caller holds the right token but speaks for a worker it is not."""


class ResourceExhausted(RuntimeError):
    """A bounded resource (e.g. the router's watch streams) is full: try again later."""


_STATUS = (
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def _status_of(error: Exception) -> grpc.StatusCode | None:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return None


# The details travel percent-encoded in a trailer (up to 3 bytes for each byte of UTF-8), and a
# peer refuses metadata over 8 KiB: a longer message would reach the client as RESOURCE_EXHAUSTED
# instead of the error it describes.
MAX_DETAILS_BYTES = 2048


def _bounded(message: str) -> str:
    encoded = message.encode()
    if len(encoded) <= MAX_DETAILS_BYTES:
        return message
    head = encoded[: MAX_DETAILS_BYTES - 64].decode(errors="ignore")  # room for the note
    return f"{head} ... ({len(message) - len(head)} more characters)"


def _abort(context: grpc.ServicerContext, error: Exception, method: str):
    code = _status_of(error)
    if code is None:
        log.exception("internal error in %s", method)
        context.abort(grpc.StatusCode.INTERNAL, _bounded(f"{type(error).__name__}: {error}"))
    context.abort(code, _bounded(str(error)))


def _wrap(method):
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as error:  # noqa: BLE001 - mapped to a status, never crashes
                _abort(context, error, method.__name__)

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as error:  # noqa: BLE001
            _abort(context, error, method.__name__)

    return unary


def map_errors(servicer_class):
    """Class decorator: every RPC method answers user errors with a status, never a crash."""
    for name, method in list(vars(servicer_class).items()):
        if name[0].isupper() and callable(method):
            setattr(servicer_class, name, _wrap(method))
    return servicer_class
