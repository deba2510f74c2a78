"""A step whose loss or global gradient norm is not finite is skipped, as Megatron skips such an
iteration: every worker drops its gradients and keeps its weights and optimizer state, the step is
recorded as skipped, and the run goes on, until more than train.max_skipped_steps were skipped.
The driver runs here without workers, on forged step results."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dyad.config import TrainConfig
from dyad.data import make_dataset
from dyad.optim import apply_update, build_optimizer
from dyad.router.driver import GenerationStart, RunAborted, RunDriver, step_update
from dyad.router.run import Run
from dyad.service import PoolService
from dyad.wire import pb
from tests.helpers.resilience import job_config, records_of


@pytest.mark.parametrize("loss, grad_sq_norm", [(math.nan, 4.0), (2.0, math.inf), (math.inf, math.nan)])
def test_a_non_finite_loss_or_gradient_norm_skips_the_update(loss, grad_sq_norm):
    assert step_update(7, loss, grad_sq_norm, grad_clip=1.0) == pb.ApplyCommand(step=7, skip=True)


def test_a_finite_step_is_applied_with_its_gradients_clipped():
    update = step_update(7, 2.0, 16.0, grad_clip=1.0)
    assert update.step == 7 and not update.skip and update.grad_scale == pytest.approx(0.25)
    assert step_update(7, 2.0, 0.25, grad_clip=1.0).grad_scale == 1.0


def _trained_model():
    """A model and AdamW after one real step: moments and step counts to keep."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    optimizer = build_optimizer(model, TrainConfig(steps=4))
    model(torch.randn(3, 4)).sum().backward()
    apply_update(optimizer, lr=1e-2, grad_scale=1.0)
    return model, optimizer


def test_a_skipped_apply_leaves_weights_and_optimizer_state_bitwise_unchanged():
    model, optimizer = _trained_model()
    (model(torch.randn(3, 4)).sum() * math.nan).backward()  # every gradient NaN
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    service = SimpleNamespace(optimizer=optimizer, lr=1e-2)  # what PoolService.apply uses
    assert PoolService.apply(service, pb.ApplyCommand(step=1, skip=True)) == pb.ApplyResult(step=1)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    after = optimizer.state_dict()
    assert after["param_groups"] == state["param_groups"]
    for index, saved in state["state"].items():
        assert set(after["state"][index]) == set(saved)
        for key, value in saved.items():  # exp_avg, exp_avg_sq, step
            assert torch.equal(after["state"][index][key], value), (index, key)
    assert all(p.grad is None for p in model.parameters())  # the step's gradients are gone
    model(torch.randn(3, 4)).sum().backward()  # and the next step applies as usual
    PoolService.apply(service, pb.ApplyCommand(step=2, grad_scale=1.0))
    assert all(value.item() == 2 for value in (s["step"] for s in optimizer.state_dict()["state"].values()))


def _driver(tmp_path, *overrides, loss_at=lambda step: 2.0):
    """A driver whose workers report `loss_at(step)` for each step; what it sends is kept."""
    config = job_config(tmp_path, "eval.final=false", *overrides)
    run = Run("r", config)
    driver = RunDriver(run, launcher=None, router_address="", dataset=make_dataset(config.data))
    applies = []

    def send(command, pools=None):
        if command.WhichOneof("command") == "apply":
            applies.append(command.apply)
        if command.WhichOneof("command") == "save":
            for pool in ("encoder", "llm"):
                (tmp_path / "checkpoints" / f"step_{command.save.step:08d}" / pool).mkdir(parents=True)

    def collect(kind, matches, timeout_s=None):
        if kind != "step":
            return {}
        return {
            ("encoder", 0): pb.StepResult(step=driver.step, grad_sq_norm=1.0),
            ("llm", 0): pb.StepResult(step=driver.step, grad_sq_norm=1.0, lm_loss_sum=loss_at(driver.step)),
        }

    run.send = send
    driver._collect = collect
    driver._start_generation = lambda restarting, restore_all: GenerationStart(0.0, 0.0, 0.0)
    return driver, run, applies


def _train(driver, tmp_path) -> list[dict]:
    with (
        records_of(driver.run, tmp_path) as driver._metrics_file,
        open(tmp_path / "samples.jsonl", "a") as driver._samples_file,
    ):
        try:
            driver._train_to_the_end()
        finally:
            driver.commits.close()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_one_non_finite_step_is_skipped_and_the_run_goes_on(tmp_path):
    driver, run, applies = _driver(tmp_path, "train.steps=4", loss_at=lambda step: math.nan if step == 1 else 2.0)
    records = _train(driver, tmp_path)
    assert [(a.step, a.skip) for a in applies] == [(0, False), (1, True), (2, False), (3, False)]
    steps = {r["step"]: r for r in records if "loss" in r}
    assert [steps[s]["skipped"] for s in range(4)] == [False, True, False, False]
    assert run.info().skipped_steps == 1 and run.info().step == 4


def test_more_skipped_steps_than_allowed_fail_the_run_naming_the_count_and_the_field(tmp_path):
    driver, run, applies = _driver(tmp_path, "train.steps=8", "train.max_skipped_steps=2", loss_at=lambda step: math.nan)
    with pytest.raises(RunAborted) as aborted:
        _train(driver, tmp_path)
    assert str(aborted.value).startswith(
        "3 steps skipped for a non-finite loss or gradient norm, more than train.max_skipped_steps=2"
    )
    assert [a.skip for a in applies] == [True, True, True]
    assert run.info().skipped_steps == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"]) for r in records if "loss" in r] == [(0, True), (1, True), (2, True)]


def test_max_skipped_steps_is_checked(tmp_path):
    with pytest.raises(ValueError, match="train.max_skipped_steps must be >= 0, got -1"):
        job_config(tmp_path, "train.max_skipped_steps=-1")
