"""The router's Prometheus endpoint: `/metrics` with the progress of its runs.

`RunMetrics` is the `RunObserver` the runs call (dyad/router/run.py); it keeps its own
`CollectorRegistry`, so several can live in one process (tests). Every series is labelled by
`run_id`.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from dyad.router.run import Run, RunObserver
from dyad.wire import pb


class RunMetrics(RunObserver):
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, ("run_id", *labels), registry=self.registry)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ("run_id", *labels), registry=self.registry)

        self.current_step = gauge("dyad_step", "The last step trained")
        self.loss = gauge("dyad_loss", "Loss of the last step (LM + auxiliary)")
        self.lm_loss = gauge("dyad_lm_loss", "LM loss of the last step")
        self.tokens_per_second = gauge("dyad_tokens_per_second", "Throughput of the last step")
        self.step_time = gauge("dyad_step_time_seconds", "Wall time of the last step")
        self.replicas = gauge("dyad_pool_replicas", "Ranks in each pool", "pool")
        self.generation = gauge("dyad_generation", "Current generation of the pools' membership")
        self.peak_memory = gauge(
            "dyad_pool_peak_memory_bytes",
            "The most GPU memory PyTorch has reserved on any rank of each pool (0 on CPUs)",
            "pool",
        )
        self.boundary_bytes = counter(
            "dyad_boundary_bytes_total",
            "Bytes sent across the encoder/LLM boundary (forward: embeddings, backward: grads)",
            "direction",
        )
        self.eval_loss = gauge("dyad_eval_loss", "Held-out loss per caption token at the last evaluation")
        self.eval_accuracy = gauge("dyad_eval_accuracy", "The task's held-out accuracy at the last evaluation")
        self.eval_step = gauge("dyad_eval_step", "Steps trained at the last evaluation")
        self.steps = counter("dyad_steps_total", "Steps trained (again after a recovery too)")
        self.recoveries = counter("dyad_recoveries_total", "Recoveries from a lost worker")
        self.checkpoints = counter("dyad_checkpoints_total", "Checkpoints committed")
        self.skipped = counter(
            "dyad_skipped_steps_total", "Steps whose update was skipped (a non-finite loss or gradient norm)"
        )

    def _membership(self, run: Run) -> None:
        self.generation.labels(run.run_id).set(run.generation)
        for pool, size in run.pool_sizes.items():
            self.replicas.labels(run.run_id, pool).set(size)

    def step(self, run: Run, metrics: pb.StepMetrics) -> None:
        run_id = run.run_id
        self.current_step.labels(run_id).set(metrics.step)
        self.loss.labels(run_id).set(metrics.loss)
        self.lm_loss.labels(run_id).set(metrics.lm_loss)
        self.tokens_per_second.labels(run_id).set(metrics.tokens_per_s)
        self.step_time.labels(run_id).set(metrics.step_time_s)
        self.peak_memory.labels(run_id, "encoder").set(metrics.encoder_peak_memory_gb * 1e9)
        self.peak_memory.labels(run_id, "llm").set(metrics.llm_peak_memory_gb * 1e9)
        self.boundary_bytes.labels(run_id, "forward").inc(metrics.boundary_bytes_fwd)
        self.boundary_bytes.labels(run_id, "backward").inc(metrics.boundary_bytes_bwd)
        self.steps.labels(run_id).inc()
        if metrics.skipped:
            self.skipped.labels(run_id).inc()
        self._membership(run)

    def evaluation(self, run: Run, metrics: pb.EvalMetrics) -> None:
        self.eval_loss.labels(run.run_id).set(metrics.loss)
        self.eval_accuracy.labels(run.run_id).set(metrics.accuracy)
        self.eval_step.labels(run.run_id).set(metrics.step)

    def notice(self, run: Run, notice: pb.RunNotice) -> None:
        if notice.kind == "recovery":
            self.recoveries.labels(run.run_id).inc()
        elif notice.kind == "checkpoint":
            self.checkpoints.labels(run.run_id).inc()
        self._membership(run)

    def state(self, run: Run, state: int) -> None:
        self._membership(run)

    def resize(self, run: Run) -> None:
        self._membership(run)


def start_metrics_server(port: int, host: str = "0.0.0.0") -> tuple[RunMetrics, WSGIServer]:
    """Serve a fresh `RunMetrics` at http://host:port/metrics from a daemon thread (port 0: a
    free one, `server.server_port` tells which; `server.shutdown()` stops it)."""
    metrics = RunMetrics()
    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return metrics, server
