"""An evaluation's metrics, from every worker's `EvalResult`: the held-out loss is the sum of the
LLM shards' shares (each already divided by the split's caption tokens); a sample's answer is
right when no shard of its sequence missed one of its answer tokens, and every token was
checked exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from dyad.data import ImageTokens, answer_targets
from dyad.router.steps import StepSpec
from dyad.wire import pb


def answer_lengths(dataset, specs: Iterable[StepSpec], image_tokens: ImageTokens) -> dict[int, int]:
    """Sample id -> its answer's token count, for the evaluated samples that have an answer."""
    lengths = {}
    for spec in specs:
        for sample_id in (s for microbatch in spec.microbatches for s in microbatch):
            span = answer_targets(dataset.tokenizer, dataset.sample(sample_id), image_tokens)
            if span:
                lengths[sample_id] = len(span)
    return lengths


def evaluation_metrics(
    step: int, specs: list[StepSpec], results: Iterable[pb.EvalResult], answers: dict[int, int], seconds: float
) -> pb.EvalMetrics:
    """RuntimeError where the shards' checks do not cover each answer token exactly once: the
    workers and the plan disagree."""
    checked, wrong = dict.fromkeys(answers, 0), dict.fromkeys(answers, 0)
    loss = 0.0
    for result in results:
        loss += result.lm_loss_sum
        for check in result.answers:
            if check.sample_id not in answers:
                raise RuntimeError(f"evaluation at step {step}: sample {check.sample_id} has no answer to check")
            checked[check.sample_id] += check.checked
            wrong[check.sample_id] += check.wrong
    miscounted = [s for s, length in answers.items() if checked[s] != length]
    if miscounted:
        s = miscounted[0]
        raise RuntimeError(
            f"evaluation at step {step}: sample {s}'s {answers[s]} answer tokens were checked "
            f"{checked[s]} times over the LLM's shards ({len(miscounted)} samples so)"
        )
    correct = sum(1 for s in answers if wrong[s] == 0)
    return pb.EvalMetrics(
        step=step,
        loss=loss,
        target_tokens=specs[0].target_tokens if specs else 0,
        samples=sum(len(microbatch) for spec in specs for microbatch in spec.microbatches),
        accuracy=correct / len(answers) if answers else math.nan,
        answered=len(answers),
        seconds=seconds,
    )
