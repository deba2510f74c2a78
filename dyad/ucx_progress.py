"""Which of ucxx's progress modes a worker's UCX transport runs, decided without importing
ucxx (the launchers also ask, to leave the polling thread its core: `dyad.cpus`). The router's
local launcher names the mode for its workers from the run's device (`worker_progress_env`), so
that it never imports torch to ask whether CUDA is present."""

from __future__ import annotations

import os
from collections.abc import Mapping

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
        import torch  # a worker's own question; the router's workers are told (worker_progress_env)

        return default_progress_mode(torch.cuda.is_available())
    if mode not in PROGRESS_MODES:
        raise ValueError(f"{source} must be one of {', '.join(PROGRESS_MODES)}, got {mode!r}")
    return mode


def default_progress_mode(cuda: bool) -> str:
    """Polling where the boundary's buffers are on CUDA devices, else a waiting thread."""
    return "thread-polling" if cuda else "thread"


def worker_progress_env(device: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a launcher adds to its workers' environment for a run on `device`: the default mode
    for that device, unless `environ` (default: this process's) names one already."""
    environ = os.environ if environ is None else environ
    if PROGRESS_ENV in environ:
        return {}
    return {PROGRESS_ENV: default_progress_mode(device == "cuda")}


def busy_threads(environ: Mapping[str, str] | None = None) -> int:
    """Cores a worker's UCX transport keeps busy: its progress thread, when it polls."""
    return 1 if progress_mode(environ=environ) == "thread-polling" else 0
