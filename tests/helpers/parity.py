"""Comparisons shared by the layout-parity tests.

Relative error of a tensor: |actual - expected| / |expected|.

- From identical parameters (the first step), gradients are compared in the max norm: no entry
  may be off by more than the tolerance relative to the tensor's largest entry.
- After AdamW steps (end-to-end runs, `dyad verify`), parameters are compared in the 2-norm
  (`dyad.app.verify`). AdamW divides each entry's update by that entry's own gradient magnitude, so a rounding
  difference of ~1e-7 in a near-zero gradient entry becomes a visible difference in that entry's
  update while the update as a whole is unchanged; the max norm would then measure those entries,
  not the layout's math. Losses and gradient norms are compared at every step.
"""

from __future__ import annotations

import torch

RTOL = 1e-5


def relative_error(actual: torch.Tensor, expected: torch.Tensor, norm: str) -> float:
    difference = (actual.double() - expected.double())
    if norm == "max":
        return float(difference.abs().max() / expected.double().abs().max().clamp_min(1e-12))
    return float(difference.norm() / expected.double().norm().clamp_min(1e-12))


def assert_tensors_close(actual: dict, expected: dict, what: str, norm: str = "max") -> None:
    assert actual.keys() == expected.keys(), f"{what}: {sorted(set(actual) ^ set(expected))}"
    for name, value in expected.items():
        error = relative_error(actual[name], value, norm)
        assert error <= RTOL, f"{what} {name}: relative error ({norm} norm) {error:.2e}"


def assert_close(actual: float, expected: float, what: str) -> None:
    assert abs(actual - expected) <= RTOL * max(abs(expected), 1e-8), f"{what}: {actual} vs {expected}"
