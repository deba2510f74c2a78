"""A run whose loss is not finite skips those steps' updates and fails once it has skipped more
than train.max_skipped_steps, instead of training on NaN to the end and reporting success. A
learning rate of 1e30 is legal and sends every weight past what float32 computes with in one
update: the first step trains, every later loss is NaN."""

from __future__ import annotations

import json
import math

from dyad.wire import pb
from tests.helpers.resilience import in_process_router, job_config, run_followed


def test_a_run_that_diverges_fails_after_max_skipped_steps(tmp_path):
    config = job_config(tmp_path, "train.lr=1e30", "train.warmup_steps=0", "train.max_skipped_steps=2")
    with in_process_router() as (client, _):
        run = run_followed(client, config)
    assert run.info.state == pb.RUN_STATE_FAILED, run.info.message
    assert run.info.message.startswith(
        "3 steps skipped for a non-finite loss or gradient norm, more than train.max_skipped_steps=2"
    ), run.info.message
    assert run.info.skipped_steps == 3 and run.info.recoveries == 0
    assert [run.steps[s].skipped for s in sorted(run.steps)] == [False, True, True, True]
    assert math.isfinite(run.steps[0].loss) and not math.isfinite(run.steps[3].loss)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"]) for r in records if "loss" in r] == [(0, False), (1, True), (2, True), (3, True)]
