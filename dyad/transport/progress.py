"""Which of ucxx's progress modes a worker's UCX transport runs, decided without importing
ucxx (the launchers also ask, to leave the polling thread its core: `dyad.cpus`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

PROGRESS_MODES = ("thread", "thread-polling")
PROGRESS_ENV = "DYAD_UCX_PROGRESS"


def progress_mode(asked: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """`asked`, else $DYAD_UCX_PROGRESS in `environ` (default: this process's), else polling
    where CUDA is present. Only ucxx's two threaded modes: the others turn off the notifier
    thread that completes our futures (and an inherited UCXPY_PROGRESS_MODE is never read)."""
    source = "progress" if asked is not None else PROGRESS_ENV
    environ = os.environ if environ is None else environ
    mode = asked if asked is not None else environ.get(PROGRESS_ENV)
    if mode is None:
        return "thread-polling" if torch.cuda.is_available() else "thread"
    if mode not in PROGRESS_MODES:
        raise ValueError(f"{source} must be one of {', '.join(PROGRESS_MODES)}, got {mode!r}")
    return mode


def busy_threads(environ: Mapping[str, str] | None = None) -> int:
    """Cores a worker's UCX transport keeps busy: its progress thread, when it polls."""
    return 1 if progress_mode(environ=environ) == "thread-polling" else 0
