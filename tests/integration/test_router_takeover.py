"""A router that died between its sends: the LLM worker has the next step's command and waits
for image rows from an encoder that never got it. The router started on the same state database
sends the encoder the command it missed, the LLM finishes its step, both register again, and the
run goes on in place from its last checkpoint (no recovery) with the uninterrupted run's losses."""

from __future__ import annotations

import os

from dyad import config as config_lib
from dyad.app.client import RouterClient
from dyad.router.launcher import free_ports
from dyad.wire import pb
from tests.helpers import router_death
from tests.helpers.resilience import (
    CREDENTIALS,
    assert_losses_match,
    follow,
    in_process_router,
    job_config,
    run_followed,
    start_router,
    trained_samples,
)

DIES_AT_STEP = 5


def test_a_router_that_died_between_its_sends_is_taken_over_in_place(tmp_path):
    with in_process_router() as (client, _):
        baseline = run_followed(client, job_config(tmp_path / "baseline"))
    assert baseline.info.state == pb.RUN_STATE_SUCCEEDED, baseline.info.message

    port = free_ports(1)[0]
    first = start_router(tmp_path, port, "router-1", router_death.environment(dict(os.environ), DIES_AT_STEP))
    second = None
    client = RouterClient(f"127.0.0.1:{port}", token=CREDENTIALS.client_token)
    try:
        info = client.start_run(config_lib.to_yaml(job_config(tmp_path / "run")))
        assert first.wait(300) == 9, (tmp_path / "router-1.log").read_text()[-3000:]
        second = start_router(tmp_path, port, "router-2", dict(os.environ))
        run = follow(client, info.run_id)
        log = (tmp_path / "router-2.log").read_text()
        assert run.info.state == pb.RUN_STATE_SUCCEEDED, (run.info.message, log[-3000:])
        kinds = [notice.kind for notice in run.notices if notice.kind in ("resume", "recovery")]
        assert kinds == ["resume"] and run.info.recoveries == 0, (run.notices, log[-3000:])
        # Only the encoder missed the step's command; the LLM had it, and finished it.
        assert "encoder/0 missed commands" in log and "llm/0 missed commands" not in log, log[-3000:]
        assert_losses_match(run.steps, baseline.steps)
        assert trained_samples(tmp_path / "run") == trained_samples(tmp_path / "baseline")
    finally:
        client.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
