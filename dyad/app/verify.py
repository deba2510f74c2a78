"""`dyad verify`: does the configured layout reproduce single-process training?

Runs the job for N steps, then the single-process reference on the same batches from the same
initial weights, and compares per-step losses and the final state: parameters and persistent
buffers (the MoE expert bias, which no gradient touches, is only right if the job reduced its
expert counts over the right ranks).

Parameters are compared by the relative 2-norm error of each tensor, ||job - ref|| / ||ref||;
the largest entry-wise difference is printed too. AdamW divides each entry's update by that
entry's own gradient magnitude, so when a layout sums the same gradient in another order, the
~1e-7 rounding difference of a near-zero gradient entry becomes a visible difference of that one
entry's update. The 2-norm measures the update as a whole; the losses, compared every step,
measure the math directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyad.app.evaluate import load_trained
from dyad.app.jobs import JobResult
from dyad.app.reference import ReferenceTrainer
from dyad.config import RunConfig


@dataclass
class Comparison:
    losses: list[tuple[int, float, float, float]]  # (step, job, reference, relative error)
    worst_loss_error: float
    worst_param_error: float  # relative 2-norm, the pass criterion
    worst_param: str
    worst_param_max_error: float  # largest entry-wise difference relative to the tensor's largest entry

    def passed(self, tolerance: float) -> bool:
        return self.worst_loss_error <= tolerance and self.worst_param_error <= tolerance


def relative_error(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)


def tensor_relative_error(value: torch.Tensor, reference: torch.Tensor, norm: str = "l2") -> float:
    """||value - reference|| / ||reference|| in the 2-norm ("l2") or the max norm ("max")."""
    difference = value.double() - reference.double()
    if norm == "max":
        return float(difference.abs().max() / reference.double().abs().max().clamp_min(1e-12))
    return float(difference.norm() / reference.double().norm().clamp_min(1e-12))


def compare_with_reference(config: RunConfig, dataset, job: JobResult) -> Comparison:
    reference = ReferenceTrainer(config, dataset)
    losses = []
    for record in job.metrics:
        expected = reference.step(record["step"])["loss"]
        losses.append((record["step"], record["loss"], expected, relative_error(record["loss"], expected)))
    worst_param, worst_error, worst_max = "", 0.0, 0.0
    trained = load_trained(config, job.final_checkpoint())
    for pool, job_model, ref_model in zip(("encoder", "llm"), trained, (reference.encoder, reference.llm)):
        ref_state = ref_model.state_dict()
        for name, param in job_model.state_dict().items():
            error = tensor_relative_error(param, ref_state[name])
            worst_max = max(worst_max, tensor_relative_error(param, ref_state[name], "max"))
            if error >= worst_error:
                worst_param, worst_error = f"{pool}.{name}", error
    return Comparison(
        losses=losses,
        worst_loss_error=max((l[3] for l in losses), default=0.0),
        worst_param_error=worst_error,
        worst_param=worst_param,
        worst_param_max_error=worst_max,
    )
