"""Where a run's metrics go: each sink subscribes to the run (`Run.subscribe`) and is told every
step, evaluation and notice, from the one place that emits them (`Run.record_step`,
`Run.record_evaluation`, `Run.notice`).

- `RunRecords`: out_dir/metrics.jsonl, always (a line per step, per evaluation and per notice).
- `LossPlot`: out_dir/loss.png when the run ends, always (from metrics.jsonl: the whole run, a
  router restart included), the held-out loss beside the training losses.
- `TensorBoardEvents`: out_dir/tensorboard/, by default (`metrics.tensorboard`).
- `WandbRun`, `MlflowRun`: when configured (`metrics.wandb_project`, `metrics.mlflow_tracking_uri`)
  and their library is installed; offline modes work without a server.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path
from typing import Self

from dyad.config import MetricsConfig
from dyad.router.records import JsonLines, json_line
from dyad.router.run import Run, RunObserver
from dyad.wire import as_dict, pb

log = logging.getLogger(__name__)

# StepMetrics fields that are not a quantity over the run.
_NOT_PLOTTED = ("step", "skipped")


def scalars(metrics: pb.StepMetrics) -> dict[str, float]:
    """The step's quantities by name, as every sink plots them."""
    return {name: value for name, value in as_dict(metrics).items() if name not in _NOT_PLOTTED}


def eval_scalars(metrics: pb.EvalMetrics) -> dict[str, float]:
    """The evaluation's quantities by name (`eval_loss`, `eval_accuracy`, ...), as every sink
    records them."""
    return {f"eval_{name}": value for name, value in as_dict(metrics).items() if name != "step"}


def _notice_record(notice: pb.RunNotice) -> dict:
    return {
        "event": notice.kind, "step": notice.step, "generation": notice.generation,
        "recoveries": notice.recoveries, "message": notice.message,
    }


class RunRecords(RunObserver):
    """metrics.jsonl: a record per step (its metrics and generation) and per notice (an
    `event`); each line whole or not at all (a full disk raises OSError naming the file)."""

    def __init__(self, path: Path):
        self._file = JsonLines(path)

    def step(self, run: Run, metrics: pb.StepMetrics) -> None:
        self._file.write(json_line(as_dict(metrics) | {"generation": run.generation}))

    def evaluation(self, run: Run, metrics: pb.EvalMetrics) -> None:
        self._file.write(json_line({"step": metrics.step} | eval_scalars(metrics) | {"generation": run.generation}))

    def notice(self, run: Run, notice: pb.RunNotice) -> None:
        self._file.write(json_line(_notice_record(notice)))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class LossPlot(RunObserver):
    """The losses of the run's final lineage (each step's last record in metrics.jsonl), plotted
    to loss.png when the run ends. A plot that cannot be made (a full disk, a broken matplotlib)
    is a warning in the router's log: the run's outcome is its own."""

    def __init__(self, out_dir: Path):
        self._metrics, self._path = out_dir / "metrics.jsonl", out_dir / "loss.png"

    def close(self) -> None:
        try:
            steps, evaluations = {}, {}
            for line in self._metrics.read_text().splitlines():
                record = json.loads(line)
                if "event" in record:
                    continue
                if "loss" in record:
                    steps[record["step"]] = record
                elif "eval_loss" in record:
                    evaluations[record["step"]] = record
            if steps:
                _plot_losses(
                    [steps[step] for step in sorted(steps)], [evaluations[step] for step in sorted(evaluations)],
                    self._path,
                )
        except Exception as error:  # noqa: BLE001 - a plot never changes how the run ended
            log.warning("could not plot the losses to %s: %s: %s", self._path, type(error).__name__, error)


def _plot_losses(records: list[dict], evaluations: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], label="loss")
    ax.plot(steps, [r["lm_loss"] for r in records], label="lm_loss", alpha=0.7)
    if evaluations:  # after `step` steps: the weights after training step `step - 1`
        ax.plot([r["step"] - 1 for r in evaluations], [r["eval_loss"] for r in evaluations],
                "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


class TensorBoardEvents(RunObserver):
    """TensorBoard event files: every step's quantities as scalars (`train/<name>`), every
    evaluation's (`eval/<name>`) and every notice as text, written with tensorboard's own event writer (no TensorFlow, no torch)."""

    def __init__(self, logdir: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(logdir), flush_secs=10)

    def step(self, run: Run, metrics: pb.StepMetrics) -> None:
        from tensorboard.compat.proto import summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=f"train/{name}", simple_value=value)
            for name, value in scalars(metrics).items()
        ]
        self._add(metrics.step, summary_pb2.Summary(value=values))

    def evaluation(self, run: Run, metrics: pb.EvalMetrics) -> None:
        from tensorboard.compat.proto import summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=f"eval/{name.removeprefix('eval_')}", simple_value=value)
            for name, value in eval_scalars(metrics).items()
        ]
        self._add(metrics.step, summary_pb2.Summary(value=values))

    def notice(self, run: Run, notice: pb.RunNotice) -> None:
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2

        text = tensor_pb2.TensorProto(
            dtype=7,  # DT_STRING
            string_val=[f"{notice.kind}: {notice.message}".encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]),
        )
        metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        self._add(notice.step, summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=f"notices/{notice.kind}", metadata=metadata, tensor=text),
        ]))

    def _add(self, step: int, summary) -> None:
        from tensorboard.compat.proto import event_pb2

        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._writer.close()


class WandbRun(RunObserver):
    """A Weights & Biases run named after the dyad run, with its config."""

    def __init__(self, settings: MetricsConfig, run: Run, out_dir: Path):
        import wandb

        self._run = wandb.init(
            project=settings.wandb_project, mode=settings.wandb_mode, name=run.run_id, id=run.run_id,
            dir=str(out_dir), config=_plain_config(run), resume="allow",
        )

    def step(self, run: Run, metrics: pb.StepMetrics) -> None:
        self._run.log({f"train/{name}": value for name, value in scalars(metrics).items()}, step=metrics.step)

    def evaluation(self, run: Run, metrics: pb.EvalMetrics) -> None:
        self._run.log(_eval_keys(metrics), step=metrics.step)

    def close(self) -> None:
        self._run.finish()


class MlflowRun(RunObserver):
    """An MLflow run named after the dyad run, in `metrics.mlflow_experiment`."""

    def __init__(self, settings: MetricsConfig, run: Run):
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
        experiment = self._client.get_experiment_by_name(settings.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(settings.mlflow_experiment)
        )
        self._run_id = self._client.create_run(experiment_id, run_name=run.run_id).info.run_id

    def step(self, run: Run, metrics: pb.StepMetrics) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[
            Metric(key=f"train/{name}", value=value, timestamp=now, step=metrics.step)
            for name, value in scalars(metrics).items()
        ])

    def evaluation(self, run: Run, metrics: pb.EvalMetrics) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[
            Metric(key=key, value=value, timestamp=now, step=metrics.step) for key, value in _eval_keys(metrics).items()
        ])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def _eval_keys(metrics: pb.EvalMetrics) -> dict[str, float]:
    return {f"eval/{name.removeprefix('eval_')}": value for name, value in eval_scalars(metrics).items()}


def _plain_config(run: Run) -> dict:
    import yaml

    return yaml.safe_load(run.config_yaml)


def check_sinks(settings: MetricsConfig) -> None:
    """ValueError naming the field if a sink the config asks for cannot run here (the router's
    environment, where the sinks run): refused when the run is asked for, not when it starts."""
    for field, module in (("wandb_project", "wandb"), ("mlflow_tracking_uri", "mlflow")):
        if getattr(settings, field) and importlib.util.find_spec(module) is None:
            raise ValueError(f"metrics.{field} is set but {module} is not installed where the router runs (pip install {module})")


def open_sinks(run: Run, out_dir: Path) -> list[RunObserver]:
    """The sinks `run`'s config asks for, metrics.jsonl first."""
    settings = run.config.metrics
    sinks: list[RunObserver] = [RunRecords(out_dir / "metrics.jsonl"), LossPlot(out_dir)]
    if settings.tensorboard:
        sinks.append(TensorBoardEvents(out_dir / "tensorboard"))
    if settings.wandb_project:
        sinks.append(WandbRun(settings, run, out_dir))
    if settings.mlflow_tracking_uri:
        sinks.append(MlflowRun(settings, run))
    return sinks
