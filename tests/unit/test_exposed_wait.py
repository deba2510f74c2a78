"""`ExposedWait` counts the time a wait cost the device: all of it on a CPU, on a GPU only the
part the GPU spent idle."""

from __future__ import annotations

import time

import pytest
import torch

from dyad.exposed_wait import ExposedWait

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the GPU-clock measurement is not exercised"
)


def test_on_a_cpu_every_wait_counts_whole():
    waits = ExposedWait("cpu")
    for _ in range(2):
        with waits.measuring():
            time.sleep(0.02)
    assert 0.04 <= waits.seconds() < 0.5


def test_each_wait_is_counted_apart_in_order():
    waits = ExposedWait("cpu")
    for pause in (0.05, 0.01):
        with waits.measuring():
            time.sleep(pause)
    first, second = waits.each_seconds()
    assert 0.05 <= first < 0.5 and 0.01 <= second < first
    assert waits.seconds() == first + second


def _busy_for_about(seconds: float) -> None:
    """Queue roughly `seconds` of matmuls on the current stream, timed first (after a warm-up
    matmul: the process's first one also pays for cuBLAS's set-up, which made one look long)."""
    a = torch.randn(4096, 4096, device="cuda")
    a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(4):
        a @ a
    end.record()
    end.synchronize()
    one_s = max(start.elapsed_time(end) / 4e3, 1e-5)
    for _ in range(int(seconds / one_s) + 1):
        a @ a


@needs_cuda
def test_a_wait_while_the_gpu_is_busy_costs_nothing():
    waits = ExposedWait("cuda")
    _busy_for_about(0.2)
    with waits.measuring():
        time.sleep(0.05)  # the data comes while the GPU still works
    assert waits.seconds() < 0.005


@needs_cuda
def test_a_wait_on_an_idle_gpu_costs_its_length():
    waits = ExposedWait("cuda")
    torch.cuda.synchronize()
    with waits.measuring():
        time.sleep(0.05)
    _busy_for_about(0.05)  # work after the wait is not counted
    assert 0.045 <= waits.seconds() < 0.09


@needs_cuda
def test_on_a_gpu_each_wait_is_its_own_idle_time():
    waits = ExposedWait("cuda")
    torch.cuda.synchronize()
    with waits.measuring():
        time.sleep(0.05)  # the GPU is idle: the whole wait counts
    _busy_for_about(0.2)
    with waits.measuring():
        time.sleep(0.05)  # the GPU is busy: nothing counts
    idle, hidden = waits.each_seconds()
    assert 0.045 <= idle < 0.09 and hidden < 0.005
