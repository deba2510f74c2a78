"""The router's Prometheus endpoint shows what its runs did: scraped over HTTP after a run records
steps, an evaluation, notices and a resize."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dyad import config as config_lib
from dyad.router.metrics import start_metrics_server
from dyad.router.run import Run
from dyad.wire import pb


@pytest.fixture
def metrics():
    observer, server = start_metrics_server(0, host="127.0.0.1")
    yield observer, f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def step(index: int) -> pb.StepMetrics:
    return pb.StepMetrics(
        step=index, loss=2.5 - index, lm_loss=2.25 - index, tokens_per_s=1000.0 + index,
        step_time_s=0.5, boundary_bytes_fwd=4096, boundary_bytes_bwd=1024,
        encoder_peak_memory_gb=1.5 + index, llm_peak_memory_gb=70.25,
    )


def test_metrics_follow_steps_evaluations_notices_and_resizes(metrics):
    observer, url = metrics
    run = Run("run-a", config_lib.from_yaml("train: {steps: 10}"), observer=observer)
    run.new_generation(["encoder", "llm"], {})
    run.set_state(pb.RUN_STATE_RUNNING)
    samples = scrape(url)
    assert value(samples, "dyad_pool_replicas", run_id="run-a", pool="encoder") == 1
    assert value(samples, "dyad_generation", run_id="run-a") == 1

    run.record_step(step(0))
    run.record_step(step(1))
    diverged = step(1)
    diverged.skipped = True  # a skipped step, recorded as it happened
    run.record_step(diverged)
    run.record_evaluation(pb.EvalMetrics(step=2, loss=0.875, accuracy=0.625, answered=8))
    run.notice("checkpoint", 2, "committed")
    run.notice("recovery", 2, "attempt 1/3: worker llm/0 exited")
    run.resize(config_lib.scaled(run.config, "encoder", 3))
    assert value(scrape(url), "dyad_pool_replicas", run_id="run-a", pool="encoder") == 3
    run.new_generation(["encoder"], {})
    run.notice("resize", 2, "encoder 1 -> 3 in 1.0s")

    samples = scrape(url)
    labels = {"run_id": "run-a"}
    assert value(samples, "dyad_step", **labels) == 1
    assert value(samples, "dyad_loss", **labels) == 1.5
    assert value(samples, "dyad_lm_loss", **labels) == 1.25
    assert value(samples, "dyad_tokens_per_second", **labels) == 1001.0
    assert value(samples, "dyad_step_time_seconds", **labels) == 0.5
    assert value(samples, "dyad_pool_peak_memory_bytes", pool="encoder", **labels) == 2.5e9
    assert value(samples, "dyad_pool_peak_memory_bytes", pool="llm", **labels) == 70.25e9
    assert value(samples, "dyad_steps_total", **labels) == 3
    assert value(samples, "dyad_skipped_steps_total", **labels) == 1
    assert value(samples, "dyad_boundary_bytes_total", direction="forward", **labels) == 3 * 4096
    assert value(samples, "dyad_boundary_bytes_total", direction="backward", **labels) == 3 * 1024
    assert value(samples, "dyad_checkpoints_total", **labels) == 1
    assert value(samples, "dyad_eval_loss", **labels) == 0.875
    assert value(samples, "dyad_eval_accuracy", **labels) == 0.625
    assert value(samples, "dyad_eval_step", **labels) == 2
    assert value(samples, "dyad_recoveries_total", **labels) == 1
    assert value(samples, "dyad_generation", **labels) == 2
    assert value(samples, "dyad_pool_replicas", pool="encoder", **labels) == 3
    assert value(samples, "dyad_pool_replicas", pool="llm", **labels) == 1


def test_each_server_has_its_own_registry(metrics):
    _, url = metrics
    other, server = start_metrics_server(0, host="127.0.0.1")
    try:
        Run("run-b", config_lib.from_yaml("train: {steps: 1}"), observer=other).record_step(step(0))
        assert ("dyad_steps_total", frozenset({("run_id", "run-b")})) not in scrape(url)
        other_url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert value(scrape(other_url), "dyad_steps_total", run_id="run-b") == 1
    finally:
        server.shutdown()
        server.server_close()
