"""What a worker may report: every value of a `WorkerResult` checked before the run sees it.

A worker's numbers drive the run (the global gradient norm clips every rank's update, the losses
are what users read), so a value no worker computes is refused with the field named, never
trained on. The step's loss and gradient norm may be NaN or infinite: that is how a diverged
step reads, and the driver skips it (`StepMetrics.skipped`).
"""

from __future__ import annotations

import math

from dyad.wire import pb

# May be NaN or +inf (a diverged step), never negative.
_DIVERGING = ("grad_sq_norm", "lm_loss_sum")
# Finite and >= 0.
_COUNTS = (
    "tokens", "boundary_bytes_sent", "boundary_bytes_received", "boundary_wait_s",
    "boundary_fill_wait_s", "peak_memory_gb",
)
_MAX_ERROR_CHARS = 64 * 1024  # a traceback; the router keeps and logs it


def check_result(result: pb.WorkerResult, total_steps: int) -> None:
    """ValueError naming the field if `result` holds a value no worker reports."""
    which = result.WhichOneof("result")
    if which is None:
        raise ValueError("result must be one of step, apply, save, setup, evaluate or error")
    if result.generation < 0:
        raise ValueError(f"generation must be >= 0, got {result.generation}")
    if which == "error":
        if len(result.error) > _MAX_ERROR_CHARS:
            raise ValueError(f"error must be at most {_MAX_ERROR_CHARS} characters, got {len(result.error)}")
        return
    body = getattr(result, which)
    if which in ("step", "apply", "save", "evaluate") and not 0 <= body.step <= total_steps:
        raise ValueError(f"{which}.step must be in [0, {total_steps}], got {body.step}")
    if which == "step":
        _check_step(body)
    elif which == "evaluate":
        _check_evaluation(body)


def _check_step(step: pb.StepResult) -> None:
    for name in _DIVERGING:
        value = getattr(step, name)
        if value < 0:
            raise ValueError(f"step.{name} must be >= 0 (or NaN/inf for a diverged step), got {value}")
    if step.aux_loss == -math.inf:
        raise ValueError(f"step.aux_loss must not be -inf, got {step.aux_loss}")
    for name in _COUNTS:
        value = getattr(step, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"step.{name} must be finite and >= 0, got {value}")


def _check_evaluation(result: pb.EvalResult) -> None:
    if not result.lm_loss_sum >= 0 and not math.isnan(result.lm_loss_sum):
        raise ValueError(f"evaluate.lm_loss_sum must be >= 0 (or NaN), got {result.lm_loss_sum}")
    for name in ("boundary_bytes_sent", "boundary_bytes_received"):
        value = getattr(result, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"evaluate.{name} must be finite and >= 0, got {value}")
    for check in result.answers:
        if not 0 <= check.wrong <= check.checked:
            raise ValueError(
                f"evaluate.answers of sample {check.sample_id}: wrong must be in [0, checked={check.checked}], "
                f"got {check.wrong}"
            )
