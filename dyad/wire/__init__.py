"""The gRPC wire contract, generated from `proto/` the first time it is imported.

The stubs (`dyad_pb2.py`, `dyad_pb2_grpc.py`) are build products: they are regenerated whenever
the .proto source is newer, never edited by hand, and not committed.
"""

from __future__ import annotations

import fcntl
import importlib
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
_SOURCE_ROOT = _PACKAGE_DIR.parent.parent
_PROTO_ROOT = _SOURCE_ROOT / "proto"
_PROTO_FILE = _PROTO_ROOT / "dyad" / "wire" / "dyad.proto"
_STUBS = (_PACKAGE_DIR / "dyad_pb2.py", _PACKAGE_DIR / "dyad_pb2_grpc.py")

# Small on purpose: a tensor sent through gRPC by mistake must fail loudly. Plans for large
# batches stay well below this.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def _stubs_are_fresh() -> bool:
    if not all(stub.exists() for stub in _STUBS):
        return False
    if not _PROTO_FILE.exists():  # installed without sources: use what was built
        return True
    source_time = _PROTO_FILE.stat().st_mtime
    return all(stub.stat().st_mtime >= source_time for stub in _STUBS)


def _generate_stubs() -> None:
    from grpc_tools import protoc

    if not _PROTO_FILE.exists():
        raise RuntimeError(f"the wire contract {_PROTO_FILE} is missing and no stubs were built")
    include = Path(importlib.import_module("grpc_tools").__file__).parent / "_proto"
    # Outputs land beside this file because the proto's path mirrors the package path.
    out_root = _PACKAGE_DIR.parent.parent
    args = [
        "protoc",
        f"-I{_PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(_PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {_PROTO_FILE}")


def _ensure_stubs() -> None:
    if _stubs_are_fresh():
        return
    with open(_PACKAGE_DIR / ".generate.lock", "w") as lock:  # several processes may import
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _stubs_are_fresh():
            _generate_stubs()


_ensure_stubs()

from dyad.wire import dyad_pb2 as pb  # noqa: E402
from dyad.wire import dyad_pb2_grpc as rpc  # noqa: E402


def as_dict(message) -> dict:
    """A flat message's fields by name (metrics records, progress lines)."""
    return {field.name: getattr(message, field.name) for field in message.DESCRIPTOR.fields}


__all__ = ["pb", "rpc", "GRPC_OPTIONS", "MAX_MESSAGE_BYTES", "as_dict"]
