"""`dyad plan`: `dyad train --dry-run`'s report, and with --device-memory a warning for exactly the
ranks (and the GPUs several share) whose estimate exceeds it; a warning is not a failure."""

from __future__ import annotations

import pytest

from dyad import config as config_lib
from dyad.app.cli import main
from dyad.app.dry_run import GIB, rank_memories
from dyad.data import make_dataset
from dyad.router.steps import StepPlanner

OVERRIDES = ["parallel.llm.dp=2", "parallel.encoder.dp=2", "train.dtype=bfloat16"]


def run(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    return out


def estimates(overrides: list[str]) -> dict[tuple[str, int], int]:
    """Each rank's estimated bytes, as the plan computes them for step 0."""
    config = config_lib.load(None, overrides)
    dataset = make_dataset(config.data)
    config = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    planner = StepPlanner(config, dataset)
    spec = planner.next(0)
    ranks = rank_memories(config, dataset, planner.image_tokens, spec, planner.boundary_plan(spec))
    return {(r.pool, r.rank): r.memory.total for r in ranks}


def warned(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("warning:")]


def test_plan_prints_the_dry_run_report(capsys):
    planned = run(capsys, "plan", "digits", *OVERRIDES)
    dry_run = run(capsys, "train", "--dry-run", "--config", "digits", *[a for o in OVERRIDES for a in ("--set", o)])
    assert planned.startswith("dyad plan: digits resolved and checked as a run is; nothing started")
    assert planned.splitlines()[1:] == dry_run.splitlines()[1:]
    assert "every rank fits" not in planned and not warned(planned)  # no device memory given


def test_a_warning_names_exactly_the_ranks_past_the_device_memory(capsys):
    totals = estimates(OVERRIDES)
    ordered = sorted(set(totals.values()))
    assert len(ordered) > 1  # the ranks differ: the pools, and the LLM's lanes' microbatches
    for limit in (ordered[0] - 1, ordered[-2], ordered[-1] - 1):
        out = run(capsys, "plan", "digits", *OVERRIDES, "--device-memory", repr(limit / GIB))
        expected = sorted(f"warning: {pool} rank {rank} " for (pool, rank), total in totals.items() if total > limit)
        assert sorted(line[: line.index("(")] for line in warned(out)) == expected
        pool, rank = next(key for key, total in totals.items() if total > limit)
        line = next(line for line in warned(out) if line.startswith(f"warning: {pool} rank {rank} "))
        shortfall = (totals[(pool, rank)] - limit) / GIB
        assert f", {shortfall:.1f} GiB more than the device's {limit / GIB:g} GiB" in line
    out = run(capsys, "plan", "digits", *OVERRIDES, "--device-memory", repr(ordered[-1] / GIB))
    assert not warned(out)
    assert f"every rank fits a device of {ordered[-1] / GIB:g} GiB" in out


def test_a_gpu_both_pools_share_holds_their_sum(capsys):
    shared = [*OVERRIDES, "parallel.encoder_devices=[0, 1]", "parallel.llm_devices=[1, 0]"]
    totals = estimates(shared)
    gpu0 = totals[("encoder", 0)] + totals[("llm", 1)]
    limit = max(totals.values())  # every rank fits, no GPU does
    out = run(capsys, "plan", "digits", *shared, "--device-memory", repr(limit / GIB))
    assert "GPUs that hold several ranks:" in out
    assert f"    GPU 0: encoder 0 + llm 1 = {gpu0 / GIB:.1f} GiB" in out
    assert [line.split(",")[0] for line in warned(out)] == [
        "warning: GPU 0 holds encoder rank 0 and llm rank 1", "warning: GPU 1 holds encoder rank 1 and llm rank 0",
    ]
