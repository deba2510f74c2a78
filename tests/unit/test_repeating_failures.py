"""A worker that runs out of GPU memory says the failure would repeat, and the router ends the
run with a message saying what to change instead of restarting from the checkpoint into the same
failure (two H100s once spent minutes on three such recoveries, each compiling the blocks again).
Any other failure stays a recovery."""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from dyad.app.worker import StepProfiler, WorkerRuntime, would_repeat
from dyad.gc_pauses import GcPauses
from dyad.pools import pool_type
from dyad.router.driver import RunAborted, RunDriver, WorkerLost
from dyad.wire import pb

OUT_OF_MEMORY = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")


def test_only_running_out_of_gpu_memory_would_repeat():
    assert would_repeat(OUT_OF_MEMORY)
    assert not would_repeat(RuntimeError("NCCL error: remote process exited"))
    assert not would_repeat(ConnectionError("recv of a tag from a peer failed"))


@pytest.mark.parametrize("error", [
    # NCCL's own allocation in an all-reduce, as a worker reported it on two H100s
    torch.distributed.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3780, unhandled cuda error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.28.9\nncclUnhandledCudaError: Call to CUDA "
        "function failed.\nLast error:\nCuda failure 2 'out of memory'"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
])
def test_running_out_of_gpu_memory_outside_torchs_allocator_would_repeat_too(error):
    assert would_repeat(error)
    assert not would_repeat(torch.distributed.DistBackendError("NCCL error: unhandled system error, remote process exited"))


class _Stub:
    """The router's side of a worker's command stream: one step command, then the reports."""

    def __init__(self):
        self.reports: list[pb.WorkerResult] = []

    def Commands(self, request):  # noqa: N802 - the gRPC method's name
        yield pb.WorkerCommand(step=pb.StepCommand(step=3))

    def ReportResult(self, result, timeout):  # noqa: N802
        self.reports.append(result)


class _Service:
    def __init__(self, error: Exception):
        self.error = error

    def step(self, command):
        raise self.error


def _runtime() -> WorkerRuntime:
    runtime = object.__new__(WorkerRuntime)  # no router connection: its stub is _Stub
    runtime.run_id, runtime.pool, runtime.rank, runtime.generation = "run", "llm", 0, 1
    runtime.worker_key, runtime.last_command = b"issued-at-registration", 0
    runtime.worker = pb.WorkerId(pool=pool_type("llm").wire_id, rank=0)
    runtime.stub = _Stub()
    runtime._gc = GcPauses()
    runtime._profiled = StepProfiler.from_environment("llm", 0)
    weakref.finalize(runtime, runtime._gc.close)
    return runtime


@pytest.mark.parametrize("error, repeats", [(OUT_OF_MEMORY, True), (RuntimeError("a peer died"), False)])
def test_the_worker_reports_whether_its_failure_would_repeat_and_logs_it(error, repeats, caplog):
    runtime = _runtime()
    with pytest.raises(type(error)), caplog.at_level(logging.ERROR, logger="dyad.app.worker"):
        runtime._execute(_Service(error))
    [report] = runtime.stub.reports
    assert report.WhichOneof("result") == "error" and type(error).__name__ in report.error
    assert report.error_repeats is repeats
    # Its own log names it too: cleaning up after it may hang before the interpreter prints it.
    [logged] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert logged.startswith("failed (reported to the router): Traceback") and logged.endswith(str(error))


def test_a_worker_that_cannot_build_its_service_reports_it_for_the_generation_it_joined(monkeypatch):
    class _DoesNotFit:
        def __init__(self, *args, **kwargs):
            raise OUT_OF_MEMORY

    monkeypatch.setattr("dyad.app.worker.pool_type", lambda pool: SimpleNamespace(service_class=lambda: _DoesNotFit))
    runtime = _runtime()
    runtime.generation = 4  # what registering into generation 4 sets (WorkerRuntime.run)
    with pytest.raises(torch.OutOfMemoryError):
        runtime._built(config=None, transport=None)
    [report] = runtime.stub.reports
    assert report.generation == 4 and report.error_repeats and "OutOfMemoryError" in report.error


def _driver_with(result: pb.WorkerResult | None, *, reported=None, dead=()) -> RunDriver:
    """A RunDriver whose run has one registered worker, `result` waiting in its queue, the
    failure `reported` on record for it, and the launcher's `dead` workers."""
    results = queue.Queue()
    if result is not None:
        results.put(result)
    run = SimpleNamespace(
        registered=lambda: {("llm", 0): SimpleNamespace(last_seen=time.monotonic())},
        generation=1,
        results=results,
        stop_requested=threading.Event(),
        config=SimpleNamespace(router=SimpleNamespace(step_timeout_s=10.0, worker_timeout_s=60.0)),
        failure_of=lambda key: reported if key == ("llm", 0) else None,
    )
    driver = object.__new__(RunDriver)  # only the waiting is under test
    driver.run, driver.launcher = run, SimpleNamespace(dead=lambda: list(dead))
    driver.step, driver._early = 0, []
    return driver


def _failure(repeats: bool) -> pb.WorkerResult:
    return pb.WorkerResult(
        run_id="run", worker=pb.WorkerId(pool=pool_type("llm").wire_id, rank=0), generation=1,
        error="Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory.",
        error_repeats=repeats,
    )


def test_the_router_ends_the_run_on_a_failure_that_would_repeat_and_says_what_to_change():
    with pytest.raises(RunAborted) as aborted:
        _driver_with(_failure(repeats=True))._collect("step", lambda result: True)
    message = str(aborted.value)
    assert aborted.value.state == pb.RUN_STATE_FAILED
    assert "worker llm/0 ran out of GPU memory in its step" in message
    assert "without recovering" in message and "train.microbatches" in message
    assert message.endswith("torch.OutOfMemoryError: CUDA out of memory."), message


def test_any_other_failure_is_still_a_recovery_named_by_its_exception_before_the_traceback():
    with pytest.raises(WorkerLost) as lost:
        _driver_with(_failure(repeats=False))._collect("step", lambda result: True)
    headline, traceback = str(lost.value).split("\n", 1)
    assert headline == "worker llm/0 failed: torch.OutOfMemoryError: CUDA out of memory."
    assert traceback.startswith("Traceback (most recent call last):")


def test_a_worker_that_exited_after_reporting_a_repeating_failure_ends_the_run():
    """The router may notice the exit before it reads the report: the report still wins."""
    exited = [(SimpleNamespace(pool="llm", rank=0), "exited with code 1")]
    driver = _driver_with(None, reported=_failure(repeats=True), dead=exited)
    with pytest.raises(RunAborted, match="worker llm/0 ran out of GPU memory"):
        driver._collect("setup", lambda result: True)
    with pytest.raises(WorkerLost, match="worker llm/0 exited with code 1"):
        _driver_with(None, dead=exited)._collect("setup", lambda result: True)
