"""A run's metrics reach every sink from the one place that emits them: metrics.jsonl,
TensorBoard's event files, and (installed and configured) Weights & Biases and MLflow, here in
their offline modes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dyad.config import MetricsConfig
from dyad.router.run import Run
from dyad.router.sinks import (
    LossPlot,
    MlflowRun,
    RunRecords,
    TensorBoardEvents,
    WandbRun,
    check_sinks,
    open_sinks,
)
from dyad.wire import pb
from tests.helpers.resilience import job_config

LOSSES = [2.5, 1.75, float("nan"), 1.25]


EVALUATION = pb.EvalMetrics(step=4, loss=1.5, target_tokens=2154, samples=359, accuracy=0.75, answered=359, seconds=0.25)


def _emit(run: Run) -> None:
    for step, loss in enumerate(LOSSES):
        run.record_step(pb.StepMetrics(step=step, loss=loss, lr=1e-3 * (step + 1), skipped=math.isnan(loss)))
    run.record_evaluation(EVALUATION)
    run.notice("checkpoint", 4, "committed step_00000004")


def _run(tmp_path, *overrides) -> Run:
    return Run("r0123456789a", job_config(tmp_path, *overrides))


def test_the_default_sinks_are_metrics_jsonl_and_tensorboard(tmp_path):
    run = _run(tmp_path)
    sinks = open_sinks(run, tmp_path)
    assert [type(sink) for sink in sinks] == [RunRecords, LossPlot, TensorBoardEvents]
    for sink in sinks:
        sink.close()
    (tmp_path / "b").mkdir()
    without = open_sinks(_run(tmp_path, "metrics.tensorboard=false"), tmp_path / "b")
    assert [type(sink) for sink in without] == [RunRecords, LossPlot]
    for sink in without:
        sink.close()


def test_every_step_evaluation_and_notice_reaches_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run(tmp_path)
    sinks = open_sinks(run, tmp_path)
    for sink in sinks:
        run.subscribe(sink)
    _emit(run)
    for sink in sinks:
        sink.close()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("loss", "event") for r in records] == [2.5, 1.75, None, 1.25, "event", "event"]
    assert records[4] == {
        "step": 4, "eval_loss": 1.5, "eval_target_tokens": 2154, "eval_samples": 359, "eval_accuracy": 0.75,
        "eval_answered": 359, "eval_seconds": 0.25, "generation": 0,
    }
    assert records[-1] == {"event": "checkpoint", "step": 4, "generation": 0, "recoveries": 0,
                           "message": "committed step_00000004"}

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [0, 1, 2, 3]
    assert [e.value for e in loss][:2] == [2.5, 1.75] and math.isnan(loss[2].value)
    assert [round(e.value, 6) for e in events.Scalars("train/lr")] == [0.001, 0.002, 0.003, 0.004]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(4, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(4, 0.75)]
    [text] = events.Tensors("notices/checkpoint")
    assert text.step == 4 and text.tensor_proto.string_val == [b"checkpoint: committed step_00000004"]


def test_a_sink_that_is_not_installed_is_refused_naming_the_field(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ValueError, match=r"metrics.wandb_project is set but wandb is not installed"):
        check_sinks(MetricsConfig(wandb_project="p"))
    check_sinks(MetricsConfig())  # nothing asked for, nothing needed


def test_weights_and_biases_offline_gets_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional sink; pip install wandb to test it")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = _run(tmp_path, "metrics.wandb_project=dyad-test", "metrics.wandb_mode=offline")
    [sink] = [s for s in open_sinks(run, tmp_path) if isinstance(s, WandbRun)]
    run.subscribe(sink)
    _emit(run)
    sink.close()
    [offline] = list((tmp_path / "wandb").glob("offline-run-*"))
    assert offline.name.endswith(run.run_id)
    # The offline run's transaction log, read back by wandb's own inspector.
    records = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline / f"run-{run.run_id}.wandb")],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.splitlines()
    history = [json.loads(line)["history"]["item"] for line in records if '"type":"history"' in line]
    assert [item["_step"] for item in history] == [0, 1, 2, 3, 4]
    assert [item["train/loss"] for item in history[:4]] == [2.5, 1.75, "NaN", 1.25]
    assert (history[4]["_step"], history[4]["eval/loss"], history[4]["eval/accuracy"]) == (4, 1.5, 0.75)


def test_mlflow_gets_every_step_in_a_file_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is an optional sink; pip install mlflow to test it")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a store without a server, as offline as MLflow gets
    uri = (tmp_path / "mlruns").as_uri()
    run = _run(tmp_path, f"metrics.mlflow_tracking_uri={uri}", "metrics.mlflow_experiment=dyad-test")
    [sink] = [s for s in open_sinks(run, tmp_path) if isinstance(s, MlflowRun)]
    run.subscribe(sink)
    _emit(run)
    sink.close()
    client = mlflow.MlflowClient(tracking_uri=uri)
    [found] = client.search_runs([client.get_experiment_by_name("dyad-test").experiment_id])
    assert found.info.run_name == run.run_id and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert [m.step for m in history] == [0, 1, 2, 3]
    assert [m.value for m in history][:2] == [2.5, 1.75] and history[3].value == 1.25
    [accuracy] = client.get_metric_history(found.info.run_id, "eval/accuracy")
    assert (accuracy.step, accuracy.value) == (4, 0.75)


def test_the_loss_plot_is_drawn_from_the_runs_records_at_its_end(tmp_path, caplog):
    run = _run(tmp_path)
    records = RunRecords(tmp_path / "metrics.jsonl")
    run.subscribe(records)
    _emit(run)
    records.close()
    LossPlot(tmp_path).close()
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A plot that cannot be written is a warning, never the run's failure.
    (tmp_path / "loss.png").unlink()
    (tmp_path / "loss.png").mkdir()
    LossPlot(tmp_path).close()
    assert f"could not plot the losses to {tmp_path / 'loss.png'}: IsADirectoryError" in caplog.text
