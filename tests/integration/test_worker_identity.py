"""A join token lets a process register for a free rank, nothing more: a live rank stays with the
process that holds it, every later call must carry the key that process was issued, and every
reported value is checked before the run sees it."""

from __future__ import annotations

import math
import time

import grpc
import pytest

from dyad.channels import open_channel
from dyad.router.server import serve
from dyad.wire import pb, rpc
from tests.helpers.launchers import NoWorkers
from tests.helpers.resilience import CREDENTIALS

LLM0 = pb.WorkerId(pool=pb.POOL_LLM, rank=0)


@pytest.fixture
def started(tmp_path):
    """A run whose pools are starting (no worker processes), and a coordinator stub."""
    server, state = serve(launcher_factory=NoWorkers, credentials=CREDENTIALS)
    channel = open_channel(state.address, token=CREDENTIALS.join_token)
    run = state.start(f"out_dir: {tmp_path / 'run'}\ntrain: {{steps: 4}}\n")
    deadline = time.monotonic() + 60
    while run.generation == 0:  # its driver thread starts the first generation: workers may join
        assert time.monotonic() < deadline, "the run's first generation did not start"
        time.sleep(0.01)
    yield run, rpc.CoordinatorStub(channel)
    run.stop_requested.set()
    state.wait_idle(10)
    channel.close()
    server.stop(grace=None)


def _register(coordinator, run, address: str, pid: int, key: bytes = b"") -> pb.RegisterReply:
    return coordinator.Register(pb.RegisterRequest(
        run_id=run.run_id, worker=LLM0, data_address=address, pid=pid, worker_key=key,
    ))


def _code(call, *args) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call(*args)
    return raised.value.code(), raised.value.details()


def _step_result(run, key: bytes, **values) -> pb.WorkerResult:
    return pb.WorkerResult(
        run_id=run.run_id, worker=LLM0, generation=run.generation, worker_key=key,
        step=pb.StepResult(step=0, **values),
    )


def test_a_second_registration_of_a_live_rank_is_refused_and_logged(started, caplog):
    run, coordinator = started
    holder = _register(coordinator, run, "10.0.0.1:7000", pid=100)
    code, details = _code(_register, coordinator, run, "10.0.0.9:1", 666)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "llm/0 is held by a live process (pid 100)" in details
    assert "refused a second registration of llm/0 (from 10.0.0.9:1, pid 666)" in caplog.text
    # The holder's channel is untouched: its address, and its key still works.
    assert run.registered()[("llm", 0)].address == "10.0.0.1:7000"
    reply = coordinator.Heartbeat(pb.HeartbeatRequest(run_id=run.run_id, worker=LLM0, worker_key=holder.worker_key))
    assert not reply.stop
    # The same process registering again (a broken command stream) keeps its rank and key.
    again = _register(coordinator, run, "10.0.0.1:7000", pid=100, key=holder.worker_key)
    assert again.worker_key == holder.worker_key


def test_a_silent_holder_is_replaced_and_its_key_no_longer_speaks_for_the_rank(started):
    run, coordinator = started
    old = _register(coordinator, run, "10.0.0.1:7000", pid=100).worker_key
    run.registered()[("llm", 0)].last_seen -= 3 * run.config.router.heartbeat_interval_s + 1
    new = _register(coordinator, run, "10.0.0.2:7000", pid=101).worker_key
    assert new != old
    beat = pb.HeartbeatRequest(run_id=run.run_id, worker=LLM0, worker_key=old)
    code, details = _code(coordinator.Heartbeat, beat)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "worker_key" in details


@pytest.mark.parametrize("call", ["heartbeat", "commands", "result"])
@pytest.mark.parametrize("key", [b"", b"forged"])
def test_calls_for_a_rank_need_the_key_its_holder_was_issued(started, call, key):
    run, coordinator = started
    _register(coordinator, run, "10.0.0.1:7000", pid=100)
    requests = {
        "heartbeat": lambda: coordinator.Heartbeat(
            pb.HeartbeatRequest(run_id=run.run_id, worker=LLM0, worker_key=key)),
        "commands": lambda: next(iter(coordinator.Commands(
            pb.CommandStreamRequest(run_id=run.run_id, worker=LLM0, worker_key=key)))),
        "result": lambda: coordinator.ReportResult(_step_result(run, key, lm_loss_sum=123456.0)),
    }
    code, _ = _code(requests[call])
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert run.results.empty()  # nothing forged reached the run


@pytest.mark.parametrize(
    "values, field",
    [
        ({"grad_sq_norm": -1e9}, "step.grad_sq_norm"),
        ({"lm_loss_sum": -math.inf}, "step.lm_loss_sum"),
        ({"tokens": -5}, "step.tokens"),
        ({"boundary_wait_s": math.nan}, "step.boundary_wait_s"),
        ({"peak_memory_gb": math.inf}, "step.peak_memory_gb"),
        ({"aux_loss": -math.inf}, "step.aux_loss"),
    ],
)
def test_reported_values_no_worker_computes_are_refused_naming_the_field(started, values, field):
    run, coordinator = started
    key = _register(coordinator, run, "10.0.0.1:7000", pid=100).worker_key
    code, details = _code(coordinator.ReportResult, _step_result(run, key, **values))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details
    assert run.results.empty()


def test_results_for_steps_outside_the_run_are_refused(started):
    run, coordinator = started
    key = _register(coordinator, run, "10.0.0.1:7000", pid=100).worker_key
    result = _step_result(run, key)
    result.step.step = run.config.train.steps + 1
    code, details = _code(coordinator.ReportResult, result)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "step.step must be in [0, 4]" in details


def test_a_diverged_step_is_reported_as_it_is(started):
    """NaN and infinite losses are how a diverged step reads: the run decides (it skips it)."""
    run, coordinator = started
    key = _register(coordinator, run, "10.0.0.1:7000", pid=100).worker_key
    coordinator.ReportResult(_step_result(run, key, lm_loss_sum=math.nan, grad_sq_norm=math.inf))
    reported = run.results.get_nowait()
    assert math.isnan(reported.step.lm_loss_sum) and math.isinf(reported.step.grad_sq_norm)
