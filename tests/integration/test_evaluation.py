"""Evaluation during training (`eval:`): the held-out loss and caption accuracy a run reports,
computed forward-only in the pools' own layouts, are those of its checkpoint at the same step
evaluated on one device (`dyad eval`'s functions); and a run started by `submit` has them too,
in metrics.jsonl, loss.png and `dyad watch`."""

from __future__ import annotations

import json
import math
import re

import pytest

from dyad import config as config_lib
from dyad.app.cli import main
from dyad.app.evaluate import caption_accuracy, heldout_loss, load_trained
from dyad.data import make_dataset
from dyad.router.checkpoints import checkpoint_dir
from dyad.wire import pb
from tests.helpers.resilience import CREDENTIALS, in_process_router, job_config, run_followed

BASE_STEPS = 60  # enough for answers to differ sample by sample (accuracy well inside (0, 1))


@pytest.fixture(scope="module")
def router():
    with in_process_router() as (client, _):
        yield client


@pytest.fixture(scope="module")
def trained(router, tmp_path_factory):
    """A model part way trained, for the layouts to resume from."""
    out = tmp_path_factory.mktemp("base")
    run = run_followed(router, job_config(
        out, f"train.steps={BASE_STEPS}", "train.global_batch=16", "checkpoint.interval_steps=0",
        "eval.final=false",
    ))
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    assert run.evaluations == {}  # eval.interval_steps 100 > 60 steps, and none at the end
    return out


def _single_device(out_dir, step: int) -> tuple[float, float]:
    """(held-out loss, caption accuracy) of `out_dir`'s checkpoint at `step`, on one device."""
    config = config_lib.load(out_dir / "config.yaml", [])
    dataset = make_dataset(config.data)
    config = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    encoder, llm = load_trained(config, checkpoint_dir(out_dir, step))
    loss, _ = heldout_loss(config, dataset, encoder, llm)
    accuracy, _ = caption_accuracy(config, dataset, encoder, llm)
    return loss, accuracy


LAYOUTS = {
    "one_rank_each": [],
    "encoder_dp2_llm_tp2": ["parallel.encoder.dp=2", "parallel.llm.tp=2"],
    "encoder_tp2_llm_cp2": ["parallel.encoder.tp=2", "parallel.llm.cp=2"],
    "llm_dp2_ep2": ["parallel.llm.dp=2", "parallel.llm.ep=2"],
    # resumed from one rank's checkpoint into two stages, which evaluate forward only through
    # the pipeline: the last stage's ranks report
    "llm_pp2_dp2": ["parallel.llm.pp=2", "parallel.llm.dp=2"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_evaluations_during_training_match_their_checkpoints_on_one_device(router, trained, tmp_path, layout):
    steps = BASE_STEPS + 4
    run = run_followed(router, job_config(
        tmp_path, f"train.steps={steps}", "train.global_batch=16", f"checkpoint.resume_from={trained}",
        "eval.interval_steps=2", "checkpoint.interval_steps=2", "checkpoint.keep_last=0", *LAYOUTS[layout],
    ))
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    # Every second step after the resumed one, the last being the run's end (eval.final).
    assert sorted(run.evaluations) == [BASE_STEPS + 2, steps]
    for step, evaluation in run.evaluations.items():
        loss, accuracy = _single_device(tmp_path, step)
        assert evaluation.loss == pytest.approx(loss, rel=1e-5), step
        assert evaluation.accuracy == accuracy, step  # the same samples right, counted the same
        assert 0 < evaluation.accuracy < 1
        assert evaluation.samples == evaluation.answered == 359 and evaluation.target_tokens > 0


def test_a_submitted_run_records_its_evaluations_where_users_look(router, tmp_path, monkeypatch, capsys):
    run = run_followed(router, job_config(tmp_path, "train.steps=4", "eval.interval_steps=3"))
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    assert sorted(run.evaluations) == [3, 4]  # the interval, then the end

    monkeypatch.setenv("DYAD_ROUTER", router.address)
    monkeypatch.setenv("DYAD_TOKEN", CREDENTIALS.client_token)
    with pytest.raises(SystemExit) as exited:
        main(["watch", run.info.run_id])
    watched = capsys.readouterr().out
    assert exited.value.code == 0
    for step in (3, 4):
        assert re.search(
            rf"^step {step}: held-out loss {run.evaluations[step].loss:.4f} over 359 samples, "
            rf"accuracy [\d.]+ on 359 \([\d.]+s\)$", watched, re.MULTILINE,
        ), watched
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evaluations] == [3, 4]
    final = evaluations[-1]
    assert final["eval_loss"] == pytest.approx(run.evaluations[4].loss, rel=1e-12)
    assert final["eval_samples"] == 359 and final["eval_answered"] == 359 and final["generation"] >= 1
    assert math.isfinite(final["eval_accuracy"])
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "config.yaml").is_file()


def test_a_run_with_eval_off_evaluates_nothing(router, tmp_path):
    run = run_followed(router, job_config(tmp_path, "train.steps=2", "eval.final=false", "eval.interval_steps=0"))
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    assert run.evaluations == {}
    assert "eval_loss" not in (tmp_path / "metrics.jsonl").read_text()
