"""A run resumed with another `train.steps` than the run it resumes: its learning rate's decay
bends from the resumed step, which `dyad train` prints and the router announces (a `warning`
notice, so a submitted run says it too)."""

from __future__ import annotations

from dyad import config as config_lib
from dyad.data import make_dataset
from dyad.router.checkpoints import Committed
from dyad.router.driver import RunDriver
from dyad.router.run import Run
from dyad.router.sampler import Cursor
from dyad.router.schedule import lr_at, schedule_change, steps_of_run
from tests.helpers.launchers import NoWorkers
from tests.helpers.resilience import job_config, records_of


def _source_run(tmp_path, steps: int):
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.yaml").write_text(config_lib.to_yaml(job_config(source, f"train.steps={steps}")))
    return Committed(source / "checkpoints" / "step_00000004", 4, Cursor(), {})


def test_the_change_names_both_counts_and_the_rates_at_the_resumed_step(tmp_path):
    train = job_config(tmp_path, "train.steps=12").train
    change = schedule_change(4, train, 8)
    new, old = (lr_at(4, lr=train.lr, warmup_steps=train.warmup_steps, total_steps=total,
                      min_lr_ratio=train.min_lr_ratio) for total in (12, 8))
    assert change == (f"train.steps is 12, the run resumed at step 4 had 8: the learning rate decays over "
                      f"the new count from here on (at step 4: {new:.3g}, not the {old:.3g} of the run's schedule)")
    assert schedule_change(4, train, 12) is None and schedule_change(4, train, None) is None


def test_the_steps_of_a_run_are_read_from_the_config_its_router_wrote(tmp_path):
    committed = _source_run(tmp_path, 8)
    assert steps_of_run(committed.path.parent.parent) == 8
    assert steps_of_run(tmp_path / "nowhere") is None


def test_the_router_announces_a_resume_that_changes_the_schedule(tmp_path):
    committed = _source_run(tmp_path, 8)
    for steps, expected in ((12, ["warning"]), (8, [])):
        out = tmp_path / f"resumed-{steps}"
        out.mkdir()
        config = job_config(out, f"train.steps={steps}", f"checkpoint.resume_from={committed.path.parent.parent}")
        run = Run("r", config)
        driver = RunDriver(run, NoWorkers(), "", make_dataset(config.data))
        with records_of(run, out):
            driver._continue_from(committed)
            driver._warn_of_a_changed_schedule()
        notices = [e.notice for e in run._events if e.HasField("notice")]
        assert [n.kind for n in notices] == expected
        if expected:
            assert notices[0].message.startswith("train.steps is 12, the run resumed at step 4 had 8")
