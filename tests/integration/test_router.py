"""The router refuses bad requests with the right status and a message naming the field, and
keeps serving afterwards."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dyad.app.client import RouterClient
from dyad.channels import open_channel
from dyad.router.auth import Credentials
from dyad.router.server import serve
from dyad.wire import pb, rpc
from tests.helpers.launchers import NoWorkers

CREDENTIALS = Credentials(client_token="client-secret", join_token="join-secret")


@pytest.fixture
def router(tmp_path):
    server, state = serve(launcher_factory=NoWorkers, credentials=CREDENTIALS)
    client = RouterClient(state.address, token=CREDENTIALS.client_token)
    yield client, state, tmp_path
    for run_id in state.active_run_ids():
        state.get(run_id).stop_requested.set()
    state.wait_idle(10)
    client.close()
    server.stop(grace=None)


def _error(call, *args):
    with pytest.raises(grpc.RpcError) as raised:
        call(*args)
    return raised.value


def _config(tmp_path, extra: str = "") -> str:
    return f"out_dir: {tmp_path / 'run'}\ntrain: {{steps: 2}}\n{extra}"


@pytest.mark.parametrize(
    "config_yaml, field",
    [
        ("train: {lr: -1}", "train.lr"),
        ("train: {microbatches: 0}", "train.microbatches"),
        ("train: {lrr: 0.1}", "train.lrr"),
        ("encoder: {patch_size: 17}", "encoder.patch_size"),
        ("llm: {n_kv_heads: 3}", "llm.n_kv_heads"),
        ("llm: {moe: {top_k: 9}}", "top_k"),
        ("data: {heldout_fraction: 1.5}", "data.heldout_fraction"),
        ("data: {name: jsonl}", "data.path"),
        ("parallel: {llm: {dp: 0}}", "parallel.llm.dp"),
        ("parallel: {llm: {tp: 3}}", "parallel.llm: tp (3) must divide n_heads (4)"),
        ("parallel: {llm: {dp: 2, ep: 2}}\nllm: {moe: {num_experts: 3}}", "num_experts (3) must be divisible by ep (2)"),
        ("train: {global_batch: 3, microbatches: 2}\nparallel: {llm: {dp: 2}}", "train.global_batch (3)"),
        ("parallel: {sequence_parallel: true}", "parallel.sequence_parallel needs parallel.llm.tp > 1"),
        ("train: [1, 2]", "train"),
        ("train: {steps: [", "YAML"),
    ],
)
def test_start_run_rejects_invalid_config(router, config_yaml, field):
    client, _, _ = router
    error = _error(client.start_run, config_yaml)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.details()


def test_unknown_run_id_is_not_found(router):
    client, _, _ = router
    for call in (client.get_run, client.stop_run):
        error = _error(call, "no-such-run")
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-run" in error.details()
    error = _error(lambda: list(client.watch("no-such-run")))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-run" in error.details()


def test_empty_run_id_is_invalid(router):
    client, _, _ = router
    error = _error(client.get_run, "")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "run_id" in error.details()


def test_second_run_while_one_is_active_is_refused(router):
    client, _, tmp_path = router
    first = client.start_run(_config(tmp_path))
    error = _error(client.start_run, _config(tmp_path))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert first.run_id in error.details()
    client.stop_run(first.run_id)


def test_watch_from_negative_step_is_invalid(router):
    client, _, tmp_path = router
    run = client.start_run(_config(tmp_path))
    error = _error(lambda: list(client.watch(run.run_id, from_step=-1)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "from_step" in error.details()
    client.stop_run(run.run_id)


def test_stopped_run_ends_its_watch_and_cannot_be_stopped_twice(router):
    client, state, tmp_path = router
    run = client.start_run(_config(tmp_path))
    client.stop_run(run.run_id)
    events = list(client.watch(run.run_id))
    assert events[-1].finished.state == pb.RUN_STATE_STOPPED
    error = _error(client.stop_run, run.run_id)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_worker_requests_are_validated(router):
    client, _, tmp_path = router
    run = client.start_run(_config(tmp_path))
    coordinator = rpc.CoordinatorStub(open_channel(client.address, token=CREDENTIALS.join_token))

    def register(worker, address="127.0.0.1:1", run_id=run.run_id):
        return coordinator.Register(
            pb.RegisterRequest(run_id=run_id, worker=worker, data_address=address)
        )

    cases = [
        (dict(worker=pb.WorkerId(pool=pb.POOL_ENCODER), run_id="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (dict(worker=pb.WorkerId(pool=pb.POOL_UNSPECIFIED)), grpc.StatusCode.INVALID_ARGUMENT, "worker.pool"),
        (dict(worker=pb.WorkerId(pool=pb.POOL_LLM, rank=-1)), grpc.StatusCode.INVALID_ARGUMENT, "worker.rank"),
        # Outside the pool as it is now (it may have been larger once).
        (dict(worker=pb.WorkerId(pool=pb.POOL_LLM, rank=3)), grpc.StatusCode.FAILED_PRECONDITION, "worker.rank"),
        (dict(worker=pb.WorkerId(pool=pb.POOL_LLM), address=""), grpc.StatusCode.INVALID_ARGUMENT, "data_address"),
    ]
    for kwargs, code, text in cases:
        error = _error(lambda: register(**kwargs))
        assert error.code() == code, kwargs
        assert text in error.details()
    error = _error(
        coordinator.ReportResult,
        pb.WorkerResult(run_id=run.run_id, worker=pb.WorkerId(pool=pb.POOL_LLM)),
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION  # not registered yet
    key = register(pb.WorkerId(pool=pb.POOL_LLM)).worker_key
    error = _error(
        coordinator.ReportResult,
        pb.WorkerResult(run_id=run.run_id, worker=pb.WorkerId(pool=pb.POOL_LLM), worker_key=key),
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "result" in error.details()
    client.stop_run(run.run_id)


def test_a_tensor_sized_message_fails_loudly(router):
    client, _, tmp_path = router
    payload = "# " + "x" * (8 * 1024 * 1024) + "\n" + _config(tmp_path)
    error = _error(client.start_run, payload)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_router_keeps_serving_and_reports_health(router):
    client, _, tmp_path = router
    for bad in ("train: {lr: -1}", "llm: {n_heads: 0}"):
        _error(client.start_run, bad)
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "dyad.v1.Router", "dyad.v1.Coordinator"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    run = client.start_run(_config(tmp_path))
    assert client.get_run(run.run_id).state == pb.RUN_STATE_STARTING
    client.stop_run(run.run_id)


def test_scale_requests_are_validated_before_they_are_queued(router):
    client, _, tmp_path = router
    run = client.start_run(_config(tmp_path))
    cases = [
        (pb.POOL_UNSPECIFIED, 2, "pool"),
        (pb.POOL_ENCODER, 0, "replicas must be >= 1"),
        # dp 3 cannot share the step's 2 microbatches equally.
        (pb.POOL_LLM, 3, "parallel.llm.dp=3"),
    ]
    for pool, replicas, text in cases:
        error = _error(
            client.stub.ScalePool,
            pb.ScalePoolRequest(run_id=run.run_id, pool=pool, replicas=replicas),
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (pool, replicas)
        assert text in error.details(), error.details()
    client.stop_run(run.run_id)
    for call in (lambda: client.checkpoint(run.run_id), lambda: client.scale_pool(run.run_id, "encoder", 2)):
        assert _error(call).code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_process_of_a_pool_that_reformed_cannot_register_into_the_new_generation(tmp_path):
    """An old worker registering again (e.g. after its result was refused) must not take the
    place its replacement is about to register into: the router would set up a dead process."""
    from dyad import config as config_lib
    from dyad.router.errors import FailedPrecondition
    from dyad.router.run import Run

    run = Run("r", config_lib.load(None, ["parallel.llm.dp=2", "train.microbatches=1"]))
    run.new_generation(["encoder", "llm"], {"encoder": "h:1", "llm": "h:2"})  # generation 1
    run.new_generation(["llm"], {"llm": "h:3"})  # the LLM pool re-forms: generation 2
    llm1 = pb.WorkerId(pool=pb.POOL_LLM, rank=1)
    with pytest.raises(FailedPrecondition, match="re-formed at generation 2"):
        run.register(llm1, "127.0.0.1:9", pid=1, generation=1)
    assert run.register(llm1, "127.0.0.1:9", pid=2, generation=0).dist_address == "h:3"  # a new process
    encoder = pb.WorkerId(pool=pb.POOL_ENCODER, rank=0)
    assert run.register(encoder, "127.0.0.1:8", pid=3, generation=1).generation == 2  # kept pool


def test_workers_registering_into_a_generation_that_restores_a_checkpoint_are_told_so():
    """They then skip drawing initial weights that the restore overwrites (dyad.service)."""
    from dyad import config as config_lib
    from dyad.router.run import Run

    run = Run("r", config_lib.load(None, []))
    encoder = pb.WorkerId(pool=pb.POOL_ENCODER, rank=0)
    run.new_generation(["encoder", "llm"], {"encoder": "h:1", "llm": "h:2"})  # a fresh start
    assert not run.register(encoder, "127.0.0.1:8", pid=1).restores
    run.new_generation(["encoder"], {"encoder": "h:3"}, restores=True)  # a recovery or a resize
    assert run.register(encoder, "127.0.0.1:8", pid=2).restores


def test_a_restarted_router_keeps_what_the_last_re_forming_tells_old_and_new_processes(tmp_path):
    """How long the replaced processes may take to end, and whether new ones restore a checkpoint,
    survive the router's restart: both are read back from its store."""
    from dyad import config as config_lib
    from dyad.router.run import Run
    from dyad.router.store import SqliteStore

    store = SqliteStore(tmp_path / "state.db")
    run = Run("r", config_lib.load(None, []), store)
    run.new_generation(["encoder", "llm"], {"encoder": "h:1", "llm": "h:2"})  # generation 1
    run.new_generation(["llm"], {"llm": "h:3"}, restores=True, exit_within_s=7.5)  # generation 2
    [record] = SqliteStore(tmp_path / "state.db").runs()
    again = Run.restored(record, store)
    llm0, encoder = pb.WorkerId(pool=pb.POOL_LLM, rank=0), pb.WorkerId(pool=pb.POOL_ENCODER, rank=0)
    assert again.heartbeat(llm0, b"", generation=1) == (True, 7.5)
    assert again.register(encoder, "127.0.0.1:8", pid=1).restores
