"""The next step's command goes out with this step's update (`router.send_ahead`), so each worker
starts it once its own update is queued; never where a checkpoint or a resize falls between the
two steps. The driver runs here without workers: it records what it sends and collects, and each
collected step has a result from one worker of each pool."""

from __future__ import annotations

import json
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from dyad.data import make_dataset
from dyad.pools import pool_type
from dyad.router.driver import GenerationStart, RunDriver
from dyad.router.evaluation import answer_lengths
from dyad.router.run import Run
from dyad.wire import pb
from tests.helpers.resilience import job_config, records_of


def _driver(tmp_path, *overrides, during_collect=lambda run, kind, step: None):
    config = job_config(tmp_path, "eval.final=false", *overrides)  # evaluations where a test asks
    run = Run("r", config)
    driver = RunDriver(run, launcher=None, router_address="", dataset=make_dataset(config.data))
    events: list[str] = []

    def send(command, pools=None):
        kind = command.WhichOneof("command")
        events.append(f"{kind} {getattr(command, kind).step} sent")
        if kind == "save":
            for pool in ("encoder", "llm"):
                (tmp_path / "checkpoints" / f"step_{command.save.step:08d}" / pool).mkdir(parents=True)

    def collect(kind, matches, timeout_s=None):
        events.append(f"{kind} {driver.step} collected")
        during_collect(run, kind, driver.step)
        if kind == "evaluate":  # every answer checked once, all right
            specs = [spec for spec, _ in driver.planner.heldout_batches]
            answers = answer_lengths(driver.dataset, specs, driver.planner.image_tokens)
            checks = [pb.AnswerCheck(sample_id=s, checked=n) for s, n in answers.items()]
            return {("encoder", 0): pb.EvalResult(step=driver.step),
                    ("llm", 0): pb.EvalResult(step=driver.step, lm_loss_sum=1.0, answers=checks)}
        if kind != "step":
            return {}
        return {
            (pool, 0): pb.StepResult(step=driver.step, grad_sq_norm=1.0, lm_loss_sum=2.0)
            for pool in ("encoder", "llm")
        }

    run.send = send
    driver._collect = collect
    driver._start_generation = lambda restarting, restore_all: GenerationStart(0.0, 0.0, 0.0)
    return driver, run, events


def _train(driver, tmp_path) -> None:
    with (
        records_of(driver.run, tmp_path) as driver._metrics_file,
        open(tmp_path / "samples.jsonl", "a") as driver._samples_file,
    ):
        driver._train_to_the_end()
    driver.commits.close()


def _step(n: int, *, ahead_of_the_next: bool) -> list[str]:
    """Step n's events, the next step's command among them when it goes out ahead."""
    events = [f"step {n} collected", f"apply {n} sent"]
    if ahead_of_the_next:
        events.append(f"step {n + 1} sent")
    return [*events, f"apply {n} collected"]


def test_each_step_goes_out_with_the_last_update_except_before_a_checkpoint(tmp_path):
    driver, _, events = _driver(tmp_path, "train.steps=5", "checkpoint.interval_steps=2")
    _train(driver, tmp_path)
    assert events == [
        "step 0 sent", *_step(0, ahead_of_the_next=True), *_step(1, ahead_of_the_next=False),
        "save 2 sent", "save 2 collected",
        "step 2 sent", *_step(2, ahead_of_the_next=True), *_step(3, ahead_of_the_next=False),
        "save 4 sent", "save 4 collected",
        "step 4 sent", *_step(4, ahead_of_the_next=False),  # the last step: the final checkpoint comes next
        "save 5 sent", "save 5 collected",
    ]


def test_no_step_goes_out_ahead_of_an_evaluation(tmp_path):
    """The held-out batches go out once the steps before them are applied everywhere, and the
    step after them only once the evaluation is in."""
    driver, _, events = _driver(tmp_path, "train.steps=4", "checkpoint.interval_steps=0", "eval.interval_steps=2",
                                "eval.final=true", "eval.max_samples=8")
    _train(driver, tmp_path)
    assert events == [
        "step 0 sent", *_step(0, ahead_of_the_next=True), *_step(1, ahead_of_the_next=False),
        "evaluate 2 sent", "evaluate 2 collected",
        "step 2 sent", *_step(2, ahead_of_the_next=True), *_step(3, ahead_of_the_next=False),
        "evaluate 4 sent", "evaluate 4 collected",
        "save 4 sent", "save 4 collected",
    ]


def test_without_send_ahead_each_step_waits_for_every_update(tmp_path):
    driver, _, events = _driver(tmp_path, "train.steps=3", "checkpoint.interval_steps=0", "router.send_ahead=false")
    _train(driver, tmp_path)
    assert events == [
        "step 0 sent", *_step(0, ahead_of_the_next=False),
        "step 1 sent", *_step(1, ahead_of_the_next=False),
        "step 2 sent", *_step(2, ahead_of_the_next=False),
        "save 3 sent", "save 3 collected",
    ]


def test_a_request_that_comes_after_the_next_step_went_out_waits_for_its_end(tmp_path):
    """A checkpoint requested while step 1 is already out is taken at the boundary after step 1,
    and step 2 does not go out ahead of it; a resize requested during step 2 keeps step 3 from
    going out ahead, and step 4 goes out ahead again."""

    def request(run, kind, step):
        if (kind, step) == ("apply", 0):
            run.checkpoint_requested.set()
        if (kind, step) == ("step", 2):
            run.request_scale(pb.POOL_ENCODER, 1)  # the size it has: a resize that changes nothing

    driver, run, events = _driver(tmp_path, "train.steps=5", "checkpoint.interval_steps=0", during_collect=request)
    _train(driver, tmp_path)
    assert events == [
        "step 0 sent", *_step(0, ahead_of_the_next=True), *_step(1, ahead_of_the_next=False),
        "save 2 sent", "save 2 collected",
        "step 2 sent", *_step(2, ahead_of_the_next=False),
        "save 3 sent", "save 3 collected",  # a resize waits for a checkpoint
        "step 3 sent", *_step(3, ahead_of_the_next=True), *_step(4, ahead_of_the_next=False),
        "save 5 sent", "save 5 collected",
    ]
    assert not run.has_scale_requests()


def test_step_times_follow_each_other_without_overlap(tmp_path):
    """A step sent ahead counts its time from the end of the step before, so the step times add
    up to no more than the run's."""

    def slow(run, kind, step):
        time.sleep(0.05 if kind == "apply" else 0.0)

    driver, _, _ = _driver(tmp_path, "train.steps=4", "checkpoint.interval_steps=0", during_collect=slow)
    started = time.perf_counter()
    _train(driver, tmp_path)
    elapsed = time.perf_counter() - started
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    assert len(times) == 4 and all(t >= 0.05 for t in times)
    assert sum(times) <= elapsed


def _result(pool: str, **result) -> pb.WorkerResult:
    return pb.WorkerResult(run_id="r", worker=pb.WorkerId(pool=pool_type(pool).wire_id, rank=0), generation=1, **result)


def test_a_result_of_the_step_sent_ahead_that_comes_before_its_collection_is_kept():
    """An encoder with no part in step 1 reports it before the LLM has reported step 0's update:
    collecting the updates keeps that result for step 1's collection."""
    results = queue.Queue()
    for result in (
        _result("encoder", apply=pb.ApplyResult(step=0)),
        _result("encoder", step=pb.StepResult(step=1, grad_sq_norm=0.0)),
        _result("llm", apply=pb.ApplyResult(step=0)),
    ):
        results.put(result)
    run = SimpleNamespace(
        registered=lambda: {key: SimpleNamespace(last_seen=time.monotonic()) for key in (("encoder", 0), ("llm", 0))},
        generation=1,
        results=results,
        stop_requested=threading.Event(),
        config=SimpleNamespace(router=SimpleNamespace(step_timeout_s=10.0, worker_timeout_s=60.0)),
    )
    driver = object.__new__(RunDriver)  # only the collecting is under test
    driver.run, driver.launcher = run, SimpleNamespace(dead=list)
    driver.step, driver._early = 0, []
    assert set(driver._collect("apply", lambda result: result.step == 0)) == {("encoder", 0), ("llm", 0)}
    driver.step = 1
    results.put(_result("llm", step=pb.StepResult(step=1, grad_sq_norm=2.0)))
    collected = driver._collect("step", lambda result: result.step == 1)
    assert {key: result.grad_sq_norm for key, result in collected.items()} == {("encoder", 0): 0.0, ("llm", 0): 2.0}


@pytest.mark.parametrize("value", ["1", "fast"])
def test_send_ahead_must_be_a_boolean(tmp_path, value):
    with pytest.raises(ValueError, match="router.send_ahead"):
        job_config(tmp_path, f"router.send_ahead={value}")
