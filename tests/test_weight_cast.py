"""cast_once: a float32 weight's bfloat16 copy made once per step, its gradient added straight
into the float32 .grad — the same values as autocast's cast per use."""

from __future__ import annotations

import argparse

import pytest
import torch

import dyad.kernels.grouped_mm as grouped_mm_module
from dyad.kernels.grouped_mm import grouped_mm
from dyad.kernels.weight_cast import cast_once
from dyad.llm_service.model import LLMConfig, MoELM
from dyad.llm_service.moe import MoEConfig
from dyad.init import init_parameters
from dyad.optim import build_optimizer

BF16 = torch.bfloat16


def _experts(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(3, 16, 24, generator=generator) * 0.1)
    xs = [torch.randn(10, 16, generator=generator) for _ in range(3)]
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)  # an expert with no rows
    return w, xs, offs


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="no CUDA device here: the CUDA grouped GEMM is not exercised"
        ),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_microbatches_accumulate_the_same_gradient_as_a_cast_per_use(device):
    w, xs, offs = _experts()
    w = torch.nn.Parameter(w.detach().to(device))
    xs, offs = [x.to(device) for x in xs], offs.to(device)
    reference = torch.nn.Parameter(w.detach().clone())
    for x in xs:
        with torch.autocast(device, dtype=BF16):
            y = grouped_mm(x, w, offs)
        y.float().square().sum().backward()
        expected = grouped_mm(x.to(BF16), reference.to(BF16), offs)  # autograd's ToCopy + AccumulateGrad
        expected.float().square().sum().backward()
        assert torch.equal(y, expected)
    assert w.grad.dtype == torch.float32
    assert torch.equal(w.grad, reference.grad)


def test_the_copy_is_made_once_per_version():
    w, _, _ = _experts()
    first, again = cast_once(w, BF16), cast_once(w, BF16)
    assert first.data_ptr() == again.data_ptr()
    with torch.no_grad():
        w.mul_(2)  # an in-place update bumps the version
    updated = cast_once(w, BF16)
    assert updated.data_ptr() != first.data_ptr()
    assert torch.equal(updated, w.detach().to(BF16))


def test_an_optimizer_step_renews_the_copy():
    model = torch.nn.Linear(8, 4, bias=False)
    train = argparse.Namespace(weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8, lr=0.1)
    optimizer = build_optimizer(model, train)
    before = cast_once(model.weight, BF16).detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    optimizer.step()
    after = cast_once(model.weight, BF16)
    assert not torch.equal(after, before)
    assert torch.equal(after, model.weight.detach().to(BF16))


def test_without_grad_or_for_a_non_leaf_it_is_a_plain_cast():
    w, _, _ = _experts()
    with torch.no_grad():
        assert cast_once(w, BF16).grad_fn is None
    derived = w * 1
    assert type(cast_once(derived, BF16).grad_fn).__name__ == "ToCopyBackward0"
    assert cast_once(w.detach().to(BF16), torch.float32).dtype == torch.float32


def _llm() -> MoELM:
    moe = MoEConfig(num_experts=4, top_k=2, expert_dim=16)
    cfg = LLMConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, moe=moe)
    model = MoELM(cfg)
    init_parameters(model, seed=1)
    return model


def _grads_after_two_microbatches(model: MoELM) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(50, (2, 12), generator=generator)
        with torch.autocast("cpu", dtype=BF16):
            logits, aux = model(ids)
            loss = model.loss_sum(logits, ids) + aux
        loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_a_bf16_model_trains_to_the_same_gradients(monkeypatch):
    cast_once_grads = _grads_after_two_microbatches(_llm())
    monkeypatch.setattr(grouped_mm_module, "cast_once", lambda w, dtype: w.to(dtype))
    per_use_grads = _grads_after_two_microbatches(_llm())
    for name, grad in per_use_grads.items():
        assert torch.equal(cast_once_grads[name], grad), name
