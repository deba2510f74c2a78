"""What every benchmark script here shares: the device it runs on (a GPU when there is one,
unless --toy), the header of its results (device and torch version), and writing them as JSON."""

from __future__ import annotations

import json

import torch


def bench_device(toy: bool) -> str:
    return "cpu" if toy or not torch.cuda.is_available() else "cuda"


def run_header(device: str) -> dict:
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}


def write_json(path: str | None, results: dict, indent: int | None = 1) -> None:
    """Writes `results` to `path`; nothing without a path (the script was run without --out)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=indent)
