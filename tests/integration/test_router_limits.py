"""What clients can ask of a router is bounded, and never at the workers' expense: watch streams
have their own threads and a limit, pool sizes are bounded by what the launcher runs, and a
caller that gave up while its config was validated gets no run."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest

from dyad import config as config_lib
from dyad.channels import open_channel
from dyad.router import server as server_module
from dyad.wire import pb, rpc
from tests.helpers.launchers import NoWorkers
from tests.helpers.resilience import CREDENTIALS, follow, in_process_router, job_config

WATCHERS = 200


def _wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def _watchers(address: str, run_id: str, count: int, channels: int = 4):
    """`count` WatchRun streams held open over a few connections: (channels, calls)."""
    opened = [open_channel(address, token=CREDENTIALS.client_token) for _ in range(channels)]
    calls = [
        rpc.RouterStub(opened[i % channels]).WatchRun(pb.WatchRunRequest(run_id=run_id))
        for i in range(count)
    ]
    return opened, calls


def test_a_run_trains_through_200_watchers_and_an_impostor_without_a_false_recovery(tmp_path):
    """Watchers held for the whole run take none of the threads workers need (with one pool of
    64 threads, 64 of them stalled heartbeats until a healthy worker was declared silent); a
    second registration of a live rank and results sent without its key are refused, and the
    run never notices them."""
    with in_process_router() as (client, state):
        config = job_config(tmp_path / "run", "router.worker_timeout_s=10")
        info = client.start_run(config_lib.to_yaml(config))
        channels, calls = _watchers(state.address, info.run_id, WATCHERS)
        try:
            _wait_until(lambda: state.watchers.in_use == WATCHERS, f"{WATCHERS} watchers are served")
            coordinator = rpc.CoordinatorStub(open_channel(state.address, token=CREDENTIALS.join_token))
            impostor_refusals = []

            def impersonate(metrics: pb.StepMetrics) -> None:
                if metrics.step != 1:
                    return
                llm0 = pb.WorkerId(pool=pb.POOL_LLM, rank=0)
                for attempt in (
                    lambda: coordinator.Register(pb.RegisterRequest(
                        run_id=info.run_id, worker=llm0, data_address="127.0.0.1:9", pid=1)),
                    lambda: coordinator.ReportResult(pb.WorkerResult(
                        run_id=info.run_id, worker=llm0, generation=state.get(info.run_id).generation,
                        step=pb.StepResult(step=2, lm_loss_sum=123456.0, grad_sq_norm=1e30))),
                ):
                    with pytest.raises(grpc.RpcError) as refused:
                        attempt()
                    impostor_refusals.append(refused.value.code())

            run = follow(client, info.run_id, on_step=impersonate)
            # Every watcher was served to the end: all the steps, then the run's end.
            for call in calls:
                events = list(call)
                assert len([e for e in events if e.HasField("step")]) >= config.train.steps
                assert events[-1].finished.state == pb.RUN_STATE_SUCCEEDED
        finally:
            for call in calls:
                call.cancel()
            for channel in channels:
                channel.close()
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    assert impostor_refusals == [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED]
    assert run.info.recoveries == 0 and not [n for n in run.notices if n.kind == "recovery"], run.notices
    assert sorted(run.steps) == list(range(config.train.steps))
    assert all(m.loss < 100 and m.grad_norm < 1e6 for m in run.steps.values())


@contextlib.contextmanager
def _idle_router(max_workers: int = NoWorkers.max_workers, **options):
    """A router whose runs start no workers, whose launcher runs at most `max_workers`."""

    class Bounded(NoWorkers):
        pass

    Bounded.max_workers = max_workers
    with in_process_router(launcher_factory=Bounded, **options) as (client, state):
        yield client, state


def _refused(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call(*args)
    return raised.value


def test_watchers_beyond_the_limit_get_resource_exhausted_until_one_leaves(tmp_path):
    with _idle_router(max_watchers=3) as (client, state):
        _refuse_a_watcher_beyond_the_limit(client, state, tmp_path)


def _refuse_a_watcher_beyond_the_limit(client, state, tmp_path) -> None:
    info = client.start_run(f"out_dir: {tmp_path / 'run'}\n")
    channels, calls = _watchers(state.address, info.run_id, 3, channels=1)
    _wait_until(lambda: state.watchers.in_use == 3, "3 watchers are served")
    error = _refused(lambda: next(client.watch(info.run_id)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "at most 3 WatchRun streams" in error.details() and "--max-watchers" in error.details()
    calls[0].cancel()
    _wait_until(lambda: state.watchers.in_use == 2, "a cancelled watcher's slot is free")
    again = client.stub.WatchRun(pb.WatchRunRequest(run_id=info.run_id))
    _wait_until(lambda: state.watchers.in_use == 3, "a new watcher is served")
    for call in [*calls, again]:
        call.cancel()
    channels[0].close()


def test_pool_sizes_beyond_what_the_launcher_runs_are_refused_at_start_and_at_scale(tmp_path):
    with _idle_router(max_workers=8) as (client, state):
        _refuse_pools_beyond_the_launcher(client, state, tmp_path)


def _refuse_pools_beyond_the_launcher(client, state, tmp_path) -> None:
    error = _refused(client.start_run, f"out_dir: {tmp_path / 'a'}\nparallel: {{encoder: {{dp: 10000}}}}\n")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "10000 encoder + 1 llm = 10001 worker processes" in error.details()
    assert "--max-workers" in error.details() and "(8" in error.details()
    assert state.active_run_ids() == []

    info = client.start_run(f"out_dir: {tmp_path / 'b'}\n")
    for replicas in (2147483647, 8):
        error = _refused(client.scale_pool, info.run_id, "encoder", replicas)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{replicas} encoder + 1 llm" in error.details()
    assert client.scale_pool(info.run_id, "encoder", 7).encoder_replicas == 1  # taken, applied between steps


def test_a_run_is_not_started_for_a_caller_whose_deadline_passed_during_validation(monkeypatch, tmp_path):
    """Reading a dataset's records can take longer than the client waits: the router then starts
    nothing (it once started the run two minutes after `dyad submit` had given up)."""
    client_gave_up, start_returned = threading.Event(), threading.Event()
    make_dataset = server_module.make_dataset

    def slow_dataset(config):
        assert client_gave_up.wait(60)
        return make_dataset(config)

    monkeypatch.setattr(server_module, "make_dataset", slow_dataset)
    with in_process_router(launcher_factory=NoWorkers) as (client, state):
        start = state.start

        def observed_start(*args, **kwargs):
            try:
                return start(*args, **kwargs)
            finally:
                start_returned.set()

        state.start = observed_start
        request = pb.StartRunRequest(config_yaml=f"out_dir: {tmp_path / 'run'}\n")
        error = _refused(lambda: client.stub.StartRun(request, timeout=0.5))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        client_gave_up.set()
        assert start_returned.wait(60)
        assert state.active_run_ids() == []
        assert not (tmp_path / "run").exists()
