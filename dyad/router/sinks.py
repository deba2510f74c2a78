"""Where a run's metrics go: each sink subscribes to the run (`Run.subscribe`) and is told every
step and notice, from the one place that emits them (`Run.record_step`, `Run.notice`).

- `RunRecords`: out_dir/metrics.jsonl, always (a line per step and per notice).
- `TensorBoardEvents`: out_dir/tensorboard/, by default (`metrics.tensorboard`).
- `WandbRun`, `MlflowRun`: when configured (`metrics.wandb_project`, `metrics.mlflow_tracking_uri`)
  and their library is installed; offline modes work without a server.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Self

from dyad.config import MetricsConfig
from dyad.router.records import JsonLines, json_line
from dyad.router.run import Run, RunObserver
from dyad.wire import as_dict, pb

# StepMetrics fields that are not a quantity over the run.
_NOT_PLOTTED = ("step", "skipped")


def scalars(metrics: pb.StepMetrics) -> dict[str, float]:
    """The step's quantities by name, as every sink plots them."""
    return {name: value for name, value in as_dict(metrics).items() if name not in _NOT_PLOTTED}


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

    def notice(self, run: Run, notice: pb.RunNotice) -> None:
        self._file.write(json_line(_notice_record(notice)))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class TensorBoardEvents(RunObserver):
    """TensorBoard event files: every step's quantities as scalars (`train/<name>`) and every
    notice as text, written with tensorboard's own event writer (no TensorFlow, no torch)."""

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

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


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
    sinks: list[RunObserver] = [RunRecords(out_dir / "metrics.jsonl")]
    if settings.tensorboard:
        sinks.append(TensorBoardEvents(out_dir / "tensorboard"))
    if settings.wandb_project:
        sinks.append(WandbRun(settings, run, out_dir))
    if settings.mlflow_tracking_uri:
        sinks.append(MlflowRun(settings, run))
    return sinks
