"""Data plane: tagged tensor messages between encoder and LLM workers.

`Transport` is the contract, `UcxTransport` the real one (ucxx), `LoopbackTransport` its
in-process twin for tests. `UcxTransport` is imported on first use: importing ucxx loads
libucx and sets ucxx's UCX_* defaults, which loopback-only users do not need.
"""

from dyad.transport.base import (
    Direction,
    MessageSizeError,
    MessageTag,
    Phase,
    Transport,
    TransportError,
)
from dyad.transport.loopback import LoopbackTransport

__all__ = [
    "Direction",
    "LoopbackTransport",
    "MessageSizeError",
    "MessageTag",
    "Phase",
    "Transport",
    "TransportError",
    "UcxTransport",
]


def __getattr__(name: str):
    if name == "UcxTransport":
        from dyad.transport.ucx import UcxTransport

        return UcxTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
