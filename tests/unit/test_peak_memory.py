"""Each rank reports the most GPU memory PyTorch has reserved on it (StepResult.peak_memory_gb);
the router shows the most of each pool in the step's metrics (metrics.jsonl, Prometheus)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dyad.service import PoolService


def _peak_memory_gb(device: torch.device) -> float:
    return PoolService.peak_memory_gb(SimpleNamespace(device=device))  # only the device is read


def test_a_rank_on_a_cpu_reports_no_gpu_memory():
    assert _peak_memory_gb(torch.device("cpu")) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: GPU memory is not measured")
def test_a_rank_on_a_gpu_reports_at_least_what_it_has_held():
    device = torch.device("cuda", 0)
    held = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # 0.27 GB
    peak = _peak_memory_gb(device)
    del held
    torch.cuda.empty_cache()
    assert peak >= 256 * 2**20 / 1e9
    assert _peak_memory_gb(device) == peak  # a peak: freeing leaves it
