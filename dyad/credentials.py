"""The bearer tokens of the control plane, where clients, workers and the router read them:
the client token (`$DYAD_TOKEN`, `--token-file`) for `dyad.v1.Router` calls, the join token
(`$DYAD_JOIN_TOKEN`, `--join-token-file`) for `dyad.v1.Coordinator` calls (`dyad.router.auth`
checks them)."""

from __future__ import annotations

import os
from pathlib import Path

CLIENT_TOKEN_ENV = "DYAD_TOKEN"
JOIN_TOKEN_ENV = "DYAD_JOIN_TOKEN"
# Each token's name and the flag that names its file, in every command that reads it.
_TOKENS = {
    CLIENT_TOKEN_ENV: ("client token", "--token-file"),
    JOIN_TOKEN_ENV: ("join token", "--join-token-file"),
}


def read_file(path: str | os.PathLike, what: str) -> bytes:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist")
    return path.read_bytes()


def load_token(env_var: str, path: str | None) -> str:
    """The token in `path` (surrounding whitespace stripped) if given, else in `$env_var`."""
    what, flag = _TOKENS[env_var]
    if path:
        token = read_file(path, f"{flag}: {what}").decode().strip()
        if not token:
            raise ValueError(f"{flag}: {what} file {path!r} is empty")
        return token
    token = os.environ.get(env_var, "").strip()
    if not token:
        raise ValueError(f"no {what}: pass {flag} FILE or set ${env_var}")
    return token
