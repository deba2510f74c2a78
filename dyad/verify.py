"""`dyad verify`: does the configured layout reproduce single-process training?

Runs the job for N steps, then the single-process reference on the same batches from the same
initial weights, and compares per-step losses and the final parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyad.config import RunConfig
from dyad.evaluate import load_trained
from dyad.jobs import JobResult
from dyad.reference import ReferenceTrainer


@dataclass
class Comparison:
    losses: list[tuple[int, float, float, float]]  # (step, job, reference, relative error)
    worst_loss_error: float
    worst_param_error: float
    worst_param: str

    def passed(self, tolerance: float) -> bool:
        return self.worst_loss_error <= tolerance and self.worst_param_error <= tolerance


def relative_error(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)


def tensor_relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest entry difference, relative to the reference tensor's largest magnitude."""
    scale = reference.abs().max().clamp_min(1e-12)
    return float((value.float() - reference.float()).abs().max() / scale)


def compare_with_reference(config: RunConfig, dataset, job: JobResult) -> Comparison:
    reference = ReferenceTrainer(config, dataset)
    losses = []
    for record in job.metrics:
        expected = reference.step(record["step"])["loss"]
        losses.append((record["step"], record["loss"], expected, relative_error(record["loss"], expected)))
    worst_param, worst_error = "", 0.0
    trained = load_trained(config, job.final_checkpoint())
    for pool, job_model, ref_model in zip(("encoder", "llm"), trained, (reference.encoder, reference.llm)):
        ref_params = dict(ref_model.named_parameters())
        for name, param in job_model.named_parameters():
            error = tensor_relative_error(param.detach(), ref_params[name].detach())
            if error >= worst_error:
                worst_param, worst_error = f"{pool}.{name}", error
    return Comparison(
        losses=losses,
        worst_loss_error=max((l[3] for l in losses), default=0.0),
        worst_param_error=worst_error,
        worst_param=worst_param,
    )
