"""The learning-rate schedule: linear warm-up, then cosine decay to `min_lr_ratio * lr`."""

from __future__ import annotations

import math
from pathlib import Path

import yaml


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * cosine)


def steps_of_run(out_dir: Path) -> int | None:
    """`train.steps` of the run whose config.yaml the router wrote in `out_dir` (None: none to read)."""
    try:
        steps = (yaml.safe_load((out_dir / "config.yaml").read_text()) or {}).get("train", {}).get("steps")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


def schedule_change(resumed_at: int, train, previous_steps: int | None) -> str | None:
    """What a run resumed at step `resumed_at` of a run of `previous_steps` steps should be told
    when its `train` section counts another total: the decay bends from there on (None: it does
    not)."""
    if previous_steps is None or previous_steps == train.steps:
        return None

    def rate(total_steps: int) -> float:
        return lr_at(resumed_at, lr=train.lr, warmup_steps=train.warmup_steps, total_steps=total_steps,
                     min_lr_ratio=train.min_lr_ratio)

    return (
        f"train.steps is {train.steps}, the run resumed at step {resumed_at} had {previous_steps}: the "
        f"learning rate decays over the new count from here on (at step {resumed_at}: "
        f"{rate(train.steps):.3g}, not the {rate(previous_steps):.3g} of the run's schedule)"
    )
