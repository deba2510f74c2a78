"""The optimizer math every pool and the reference share (dyad/optim.py): the gradient norm's
fused pass against float64, and the clip scale applied inside a fused AdamW's own pass."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dyad.optim import apply_update, grad_sq_norm, sq_norm


def _model_with_grads(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(33, 65), nn.LayerNorm(65), nn.Linear(65, 7))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 3.0
    return model


def _twin(model: nn.Module) -> nn.Module:
    """A copy with the same weights and gradients (deepcopy leaves the gradients behind)."""
    twin = copy.deepcopy(model)
    for a, b in zip(model.parameters(), twin.parameters()):
        b.grad = a.grad.clone()
    return twin


def test_sq_norm_matches_float64_sum_of_squares():
    grads = [torch.randn(1000, 37) * 1e3, torch.randn(5), torch.randn(2, 3, 4) * 1e-3]
    expected = sum(float(g.double().pow(2).sum()) for g in grads)
    assert float(sq_norm(grads)) == pytest.approx(expected, rel=1e-6)
    assert sq_norm(grads).dtype == torch.float64


def test_sq_norm_of_nothing_is_zero_on_the_device_named():
    total = sq_norm([], "cpu")
    assert total.dtype == torch.float64 and float(total) == 0.0


def test_grad_sq_norm_skips_parameters_without_gradients():
    model = _model_with_grads(0)
    model[1].weight.grad = None
    expected = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    assert grad_sq_norm(model.parameters()) == pytest.approx(expected, rel=1e-6)


def _optimizer(model: nn.Module, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=fused or None)


@pytest.mark.parametrize("fused", [False, True])
def test_apply_update_scales_gradients_then_clears_the_scale(fused):
    """Each step's scale, and no other: step 1 at 0.5 (a power of two, so dividing by 2 inside
    the fused pass is exactly multiplying by 0.5), step 2 at 1.0 must not reuse step 1's."""
    model = _model_with_grads(1)
    by_hand = _twin(model)
    optimizer, by_hand_optimizer = _optimizer(model, fused), _optimizer(by_hand, fused)
    for step, scale in enumerate([0.5, 1.0]):
        if step:
            for a, b in zip(model.parameters(), by_hand.parameters()):
                a.grad = torch.full_like(a, 0.25)
                b.grad = torch.full_like(b, 0.25)
        for p in by_hand.parameters():
            p.grad.mul_(scale)
        apply_update(optimizer, lr=0.01, grad_scale=scale)
        by_hand_optimizer.step()
        by_hand_optimizer.zero_grad(set_to_none=True)
        for a, b in zip(model.parameters(), by_hand.parameters()):
            assert torch.equal(a, b), f"step {step} (scale {scale})"
            assert a.grad is None


def test_fused_scale_agrees_with_multiplying_first():
    model = _model_with_grads(2)
    by_hand = _twin(model)
    optimizer, by_hand_optimizer = _optimizer(model, True), _optimizer(by_hand, True)
    for p in by_hand.parameters():
        p.grad.mul_(0.3)
    apply_update(optimizer, lr=0.01, grad_scale=0.3)
    by_hand_optimizer.step()
    for a, b in zip(model.parameters(), by_hand.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
