"""What a run leaves in its out_dir, however it was started: its config as it ran, a bounded
number of committed checkpoints, and, when a client stops it, a checkpoint of the step it had
reached."""

from __future__ import annotations

import pytest
import yaml

from dyad.router.checkpoints import committed_in
from dyad.wire import pb
from tests.helpers.resilience import in_process_router, job_config, run_followed


def test_a_stopped_run_commits_the_step_it_reached_and_a_resume_goes_on_from_it(tmp_path):
    with in_process_router() as (client, state):
        def stop_after_step_2(metrics: pb.StepMetrics) -> None:
            if metrics.step == 2:
                client.stop_run(state.active_run_ids()[0])

        stopped = run_followed(client, job_config(tmp_path / "run", "checkpoint.interval_steps=0"),
                               stop_after_step_2)
        assert stopped.info.state == pb.RUN_STATE_STOPPED, stopped.info.message
        reached = stopped.info.step
        assert reached >= 3  # the steps it had trained when it stopped
        [newest] = committed_in(tmp_path / "run")[:1]
        assert newest.step == reached, stopped.info.message
        assert stopped.info.message == f"stopped by the client at step {reached}; checkpoint {newest.path}"
        assert stopped.info.last_checkpoint == str(newest.path)

        resumed = run_followed(client, job_config(
            tmp_path / "resumed", "checkpoint.interval_steps=0", f"checkpoint.resume_from={tmp_path / 'run'}"))
    assert resumed.info.state == pb.RUN_STATE_SUCCEEDED, resumed.info.message
    assert sorted(resumed.steps) == list(range(reached, 8))


def test_only_the_newest_checkpoints_are_kept_and_the_config_is_written_as_it_ran(tmp_path):
    with in_process_router() as (client, _):
        run = run_followed(client, job_config(tmp_path, "checkpoint.interval_steps=1", "checkpoint.keep_last=2"))
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    assert [c.step for c in committed_in(tmp_path)] == [8, 7]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000007", "step_00000008"]
    # TensorBoard's event files, by default, with every step's loss as metrics.jsonl has it.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(
        {step: metrics.loss for step, metrics in run.steps.items()})
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["llm"]["vocab_size"] > 0  # derived from the tokenizer, as the workers ran it
    assert written["checkpoint"]["keep_last"] == 2
