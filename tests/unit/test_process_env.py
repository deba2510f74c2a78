"""What dyad's processes print on their own: no UCX warning about the environment, no gRPC INFO
lines. Each case runs in a fresh interpreter, since both libraries read their settings once, at
load, and the test process has loaded them already."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

UNKNOWN_UCX_VARIABLE = "UCX_DYAD_TEST_NO_SUCH_OPTION"

START_UCX_TRANSPORT = """
from dyad.transport import UcxTransport
with UcxTransport() as transport:
    print("listening on", transport.address)
"""

# dyad first, as in the CLI, the router and the workers: grpc is imported through it. A router
# stopped under its clients sends them a GOAWAY with an error code, which the client logs at INFO
# when it reads it before the closed socket, in some runs only. The peer after it sends the same
# GOAWAY and then a PING: a client that acks the PING has read the GOAWAY, in every run.
START_AND_STOP_ROUTER = """
import socket
import threading

from dyad.app.client import RouterClient
from dyad.router.auth import Credentials
from dyad.router.server import serve

server, state = serve(credentials=Credentials(client_token="c" * 32, join_token="j" * 32))
client = RouterClient(state.address, token="c" * 32)
assert client.active_run_id() == ""
server.stop(grace=None).wait()
client.channel.close()

SETTINGS = bytes.fromhex("000000" "04" "00" "00000000")
GOAWAY_INTERNAL_ERROR = bytes.fromhex("000008" "07" "00" "00000000" "00000000" "00000002")
PING, PING_ACK = (bytes.fromhex("000008" "06" + flags + "00000000") + b"dyadping" for flags in ("00", "01"))
listener = socket.create_server(("127.0.0.1", 0))
acked = threading.Event()


def go_away():
    connection, _ = listener.accept()
    connection.sendall(SETTINGS + GOAWAY_INTERNAL_ERROR + PING)
    received = b""
    while PING_ACK not in received and (more := connection.recv(65536)):
        received += more
    if PING_ACK in received:
        acked.set()
    connection.close()


threading.Thread(target=go_away, daemon=True).start()
client = RouterClient(f"127.0.0.1:{listener.getsockname()[1]}", token="c" * 32)
client.channel.subscribe(lambda state: None, try_to_connect=True)
assert acked.wait(30), "the client never acked the PING after the GOAWAY"
client.channel.close()
print("stopped")
"""


def _run(code: str, environ: dict[str, str]) -> str:
    """What `code` printed, stdout and stderr together (as in a worker's log; UCX logs to stdout)."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout
    return done.stdout


def _environ(drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    kept = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("DYAD_TLS_")}
    return kept | extra


def test_a_ucx_transport_starts_without_warning_of_unused_ucx_variables():
    # An unknown variable still draws the warning: UCX's warnings do reach the output here.
    environ = _environ(("UCX_MEMTYPE_CACHE", "UCX_WARN_UNUSED_ENV_VARS"), **{UNKNOWN_UCX_VARIABLE: "1"})
    printed = _run(START_UCX_TRANSPORT, environ)
    assert "listening on" in printed
    assert UNKNOWN_UCX_VARIABLE in printed
    assert "UCX_MEMTYPE_CACHE" not in printed


def test_the_ucx_memtype_cache_the_user_sets_is_read_without_warning():
    printed = _run(START_UCX_TRANSPORT, _environ(("UCX_WARN_UNUSED_ENV_VARS",), UCX_MEMTYPE_CACHE="n"))
    assert "listening on" in printed
    assert "unused environment variable" not in printed


def test_grpc_logs_a_goaway_at_info_level():
    """The checks below can fail: the script makes gRPC log the line when asked for INFO."""
    assert "Got goaway" in _run(START_AND_STOP_ROUTER, _environ(GRPC_VERBOSITY="INFO"))


def test_the_tests_router_and_client_log_no_goaway():
    printed = _run(START_AND_STOP_ROUTER, _environ())
    assert "stopped" in printed
    assert "Got goaway" not in printed


def test_dyad_processes_log_no_goaway_without_grpc_verbosity():
    printed = _run(START_AND_STOP_ROUTER, _environ(("GRPC_VERBOSITY",)))
    assert "stopped" in printed
    assert "Got goaway" not in printed
