"""A SIGKILLed worker's peers report their canceled transfers, often before the router has seen
the death: the recovery notice names the killed worker first all the same, and the peers'
errors only after it, as consequences, whichever of them reached the router first."""

from __future__ import annotations

import pytest

from dyad.wire import pb
from tests.helpers.resilience import in_process_router, job_config, kill, run_followed

# Each pool keeps a survivor in the LLM case: two data-parallel ranks, one microbatch each.
LAYOUTS = {"encoder": ["parallel.encoder.dp=2"], "llm": ["parallel.llm.dp=2", "train.microbatches=1"]}


@pytest.mark.parametrize("pool", sorted(LAYOUTS))
def test_the_recovery_notice_names_the_killed_worker_first(tmp_path, pool):
    killed = []
    with in_process_router() as (client, state):
        def act(metrics):  # step 3 is in flight (sent with step 2's update): the kill cuts into it
            if metrics.step == 2 and not killed:
                killed.append(state.get(state.active_run_ids()[0]).pids[f"{pool}/1"])
                kill(killed[0])

        run = run_followed(client, job_config(tmp_path, "train.steps=6", *LAYOUTS[pool]), act)
    assert killed
    assert run.info.state == pb.RUN_STATE_SUCCEEDED and run.info.recoveries == 1, run.info.message
    [recovery] = [n for n in run.notices if n.kind == "recovery"]
    first, *rest = recovery.message.splitlines()
    assert first.startswith(f"attempt 1/3: worker {pool}/1 exited with code -9"), recovery.message
    assert not any(line.startswith(f"then {pool}/1 ") for line in rest), recovery.message
