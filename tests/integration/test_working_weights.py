"""bf16 working weights (dyad/working_weights.py): the same gradients as autocast's casts at
each use, bit for bit, eager and in compiled blocks; the masters are what an optimizer updates."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from dyad import config as config_lib
from dyad.checkpoint import load_pool_state
from dyad.compile import compile_blocks
from dyad.kernels.master_weights import master_of, register_accumulated_hook
from dyad.optim import build_optimizer
from dyad.service import build_model
from dyad.working_weights import WorkingWeights, trained_parameters
from tests.helpers.resilience import run_in_process
from tests.helpers.tiny_models import llm_inputs, resolved_config

CUDA = torch.cuda.is_available()


def _llm(device="cpu"):
    config = resolved_config(["llm.n_layers=3"])
    return config, build_model(config, "llm", device)


def _two_microbatches(config, model, device="cpu") -> None:
    """Gradients accumulated over two microbatches of bf16 autocast."""
    ids, rows, positions = llm_inputs(config, device)
    for shift in range(2):
        with torch.autocast(device, dtype=torch.bfloat16):
            logits, aux = model((ids + shift) % config.llm.vocab_size, rows, positions)
            loss = logits.float().logsumexp(-1).mean() + aux
        loss.backward()


def _grads(model) -> dict[str, torch.Tensor]:
    """Each trained parameter's gradient by its name in the model (a master's for a working weight)."""
    named = {}
    for name, param in model.named_parameters():
        master = master_of(param)
        named[name] = (param if master is None else master).grad
    return named


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_gradients_equal_autocasts_casts_at_each_use_bit_for_bit(backend):
    config, plain = _llm()
    _, cast_once = _llm()
    cast_once.load_state_dict(plain.state_dict())
    working = WorkingWeights(cast_once)
    if backend:
        compile_blocks(plain, backend)
        compile_blocks(cast_once, backend)
    _two_microbatches(config, plain)
    _two_microbatches(config, cast_once)
    expected, got = _grads(plain), _grads(cast_once)
    assert expected.keys() == got.keys() and len(working.working) > 0
    for name, grad in expected.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], grad), name
    assert all(w.grad is None for w in working.working)  # handed on to the masters


def test_the_matrices_are_cast_and_the_routers_norms_and_embeddings_are_not():
    _, model = _llm()
    names_before = [name for name, _ in model.named_parameters()]
    working = WorkingWeights(model)
    assert [name for name, _ in model.named_parameters()] == names_before  # the same names, in place
    cast = set(working.masters_by_name)
    assert "layers.0.attention.wq.weight" in cast and "output.weight" in cast
    assert {"layers.1.feed_forward.w13_ED2F", "layers.1.feed_forward.shared_expert.w2.weight"} <= cast
    assert not any("router" in name or "norm" in name or "embeddings" in name for name in cast)
    for name, param in model.named_parameters():
        assert param.dtype == (torch.bfloat16 if name in cast else torch.float32), name
        if name in cast:
            assert torch.equal(param, working.masters_by_name[name].to(torch.bfloat16)), name


def test_the_optimizer_updates_the_masters_and_refresh_copies_them_into_the_working_weights():
    config, model = _llm()
    working = WorkingWeights(model)
    trained = trained_parameters(model)
    assert len(trained) == len(list(model.parameters()))
    assert all(p.dtype == torch.float32 for p in trained)
    assert {id(p) for p in working.masters()} <= {id(p) for p in trained}
    train = argparse.Namespace(weight_decay=0.01, beta1=0.9, beta2=0.95, eps=1e-8, lr=1e-2)
    optimizer = build_optimizer(trained, train)
    before = [m.detach().clone() for m in working.masters()]
    _two_microbatches(config, model)
    optimizer.step()
    working.refresh()
    for master, old, copy in zip(working.masters(), before, working.working):
        assert not torch.equal(master, old)  # updated in float32
        assert torch.equal(copy, master.to(torch.bfloat16))


@pytest.mark.skipif(not CUDA, reason="the per-expert weight-gradient GEMMs run on CUDA only")
def test_the_expert_gemms_add_a_working_weights_gradient_into_its_master_on_a_gpu():
    config, plain = _llm("cuda")
    _, cast_once = _llm("cuda")
    cast_once.load_state_dict(plain.state_dict())
    WorkingWeights(cast_once)
    _two_microbatches(config, plain, "cuda")
    _two_microbatches(config, cast_once, "cuda")
    expected, got = _grads(plain), _grads(cast_once)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


def test_a_hook_on_a_master_hears_of_its_gradient_after_the_working_weight_has_added_it():
    config, model = _llm()
    working = WorkingWeights(model)
    master = working.masters_by_name["layers.0.attention.wq.weight"]
    heard = []
    register_accumulated_hook(master, lambda param: heard.append((param, param.grad.clone())))
    _two_microbatches(config, model)
    assert [param is master for param, _ in heard] == [True, True]  # once a microbatch
    assert torch.equal(heard[-1][1], master.grad)  # the sum so far, already added in


def test_a_bf16_run_with_working_weights_is_the_run_without_bit_for_bit(tmp_path):
    """Both pools in dp2 (whose overlapped reduction hears of each master's gradient from its
    working weight's hook): the same losses and saved float32 parameters."""
    jobs = []
    for flag in ("false", "true"):
        overrides = ["train.steps=3", "train.warmup_steps=1", "train.global_batch=8", "train.dtype=bfloat16",
                     f"train.working_weights={flag}", "parallel.encoder.dp=2", "parallel.llm.dp=2"]
        config = dataclasses.replace(config_lib.load(None, overrides), out_dir=str(tmp_path / flag))
        job = run_in_process(config)
        assert job.succeeded, job.info.message
        jobs.append(job)
    plain, cast_once = jobs
    assert [m["loss"] for m in cast_once.metrics] == [m["loss"] for m in plain.metrics]
    for pool in ("encoder", "llm"):
        expected = load_pool_state(plain.final_checkpoint(), pool)
        got = load_pool_state(cast_once.final_checkpoint(), pool)
        assert expected.keys() == got.keys()
        for key, value in expected.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{pool}.{key}"


def test_working_weights_need_bf16_and_no_float8():
    with pytest.raises(ValueError, match="train.working_weights needs train.dtype 'bfloat16', got 'float32'"):
        config_lib.load(None, ["train.working_weights=true"])
    config = config_lib.load(None, ["train.working_weights=true", "train.dtype=bfloat16", "llm.fp8=true"])
    with pytest.raises(ValueError, match="train.working_weights cannot be combined with llm.fp8"):
        config_lib.resolve(config, vocab_size=32)
