"""What dyad's processes print on their own: no UCX warning about the environment. Each case
runs in a fresh interpreter, since UCX reads its settings once, at load, and the test process
has loaded it already."""

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
    # An unknown variable still draws the warning: UCX's warnings do reach stderr here.
    environ = _environ(("UCX_MEMTYPE_CACHE", "UCX_WARN_UNUSED_ENV_VARS"), **{UNKNOWN_UCX_VARIABLE: "1"})
    printed = _run(START_UCX_TRANSPORT, environ)
    assert "listening on" in printed
    assert UNKNOWN_UCX_VARIABLE in printed
    assert "UCX_MEMTYPE_CACHE" not in printed


def test_the_ucx_memtype_cache_the_user_sets_is_read_without_warning():
    printed = _run(START_UCX_TRANSPORT, _environ(("UCX_WARN_UNUSED_ENV_VARS",), UCX_MEMTYPE_CACHE="n"))
    assert "listening on" in printed
    assert "unused environment variable" not in printed
