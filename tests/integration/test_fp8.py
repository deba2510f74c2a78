"""Float8 GEMMs (dyad/kernels/fp8.py) against their plain-PyTorch references and exact matmuls, and
the LLM's float8 conversion (dyad/llm_service/fp8.py)."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

from dyad import config as config_lib
from dyad.kernels import fp8
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.llm_service.fp8 import Float8GroupedSwiGLU, Fp8Linear, convert_to_fp8
from dyad.llm_service.model import MoELM
from dyad.llm_service.moe import MoELayer
from dyad.optim import build_optimizer
from tests.helpers.experts import interleave_gate_up

E4M3_STEP = 2.0**-3  # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4


def bf16_autocast(device="cpu"):
    return torch.autocast(device, dtype=torch.bfloat16)


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantize_uses_power_of_two_row_scales_and_rounds_within_e4m3_precision():
    t = torch.randn(16, 64) * torch.logspace(-3, 3, 16).unsqueeze(1)
    codes, inverse = fp8.quantize(t, dim=1)
    assert codes.dtype == fp8.E4M3 and inverse.shape == (16, 1)
    assert torch.equal(torch.log2(inverse), torch.round(torch.log2(inverse)))  # powers of two
    assert codes.float().abs().amax() <= fp8.E4M3_MAX
    # each row's largest value lands in e4m3's top binade, so no row underflows
    assert (codes.float().abs().amax(dim=1) >= fp8.E4M3_MAX / 2).all()
    back = fp8.dequantize(codes, inverse)
    big = t.abs() > t.abs().amax(dim=1, keepdim=True) / 8  # normal range of the row
    assert ((back - t).abs()[big] <= t.abs()[big] * E4M3_STEP / 2 * 1.0001).all()


def test_rows_at_the_edge_of_a_binade_never_overflow_e4m3():
    edges = torch.tensor([448.0, 224.0, 3.5, 1.0]).unsqueeze(1)
    t = edges * torch.tensor([1 - 2**-20, 1.0, 1 + 2**-20]).repeat_interleave(4).view(1, 12)
    codes, _inverse = fp8.quantize(t, dim=1)
    assert torch.isfinite(codes.float()).all() and codes.float().abs().amax() <= fp8.E4M3_MAX


def test_an_all_zero_row_quantizes_to_zeros():
    codes, inverse = fp8.quantize(torch.zeros(2, 32), dim=1)
    assert torch.equal(fp8.dequantize(codes, inverse), torch.zeros(2, 32))


def test_fp8_linear_forward_matches_its_reference_and_is_close_to_the_exact_matmul():
    torch.manual_seed(0)
    x, w = torch.randn(8, 40, 64), torch.randn(48, 64)
    with bf16_autocast():
        y, reference = fp8.fp8_linear(x, w), fp8.linear_reference(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (8, 40, 48)
    torch.testing.assert_close(y, reference, rtol=1e-2, atol=1e-2)
    assert relative_error(y, x @ w.t()) < 0.06


def test_fp8_linear_gradients_input_in_fp8_weight_in_bf16():
    torch.manual_seed(1)
    x = torch.randn(40, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    grad = torch.randn(40, 48)
    with bf16_autocast():
        y = fp8.fp8_linear(x, w)
    y.backward(grad.to(y.dtype))
    g_bf16 = grad.to(torch.bfloat16)
    expected_x = fp8.dequantize(*fp8.quantize(g_bf16, 1)) @ fp8.dequantize(*fp8.quantize(w, 0))
    torch.testing.assert_close(x.grad, expected_x, rtol=2e-2, atol=2e-2)
    expected_w = (g_bf16.t() @ x.detach().to(torch.bfloat16)).float()
    torch.testing.assert_close(w.grad, expected_w, rtol=0, atol=0)
    assert relative_error(x.grad, grad @ w.detach()) < 0.06


def test_fp8_grouped_mm_matches_its_reference_with_an_empty_group():
    torch.manual_seed(2)
    x, w = torch.randn(30, 64), torch.randn(4, 64, 32)
    offs = torch.tensor([5, 5, 20, 30], dtype=torch.int32)  # expert 1 gets no rows
    with bf16_autocast():
        y, reference = (
            fp8.fp8_grouped_mm(x, w, offs),
            fp8.grouped_mm_reference(x, w, offs),
        )
    torch.testing.assert_close(y, reference, rtol=1e-2, atol=1e-2)
    exact = torch.cat([x[0:5] @ w[0], x[5:20] @ w[2], x[20:30] @ w[3]])
    assert relative_error(y, exact) < 0.06


def test_fp8_grouped_mm_gradients_per_expert():
    torch.manual_seed(3)
    x = torch.randn(30, 64, requires_grad=True)
    w = torch.randn(4, 64, 32, requires_grad=True)
    offs = torch.tensor([5, 5, 20, 30], dtype=torch.int32)
    grad = torch.randn(30, 32)
    with bf16_autocast():
        y = fp8.fp8_grouped_mm(x, w, offs)
    y.backward(grad.to(y.dtype))
    g, xb = grad.to(torch.bfloat16), x.detach().to(torch.bfloat16)
    wt = fp8.dequantize(*fp8.quantize(w.detach(), 2))  # each expert's rows scaled over F
    ends = [0, 5, 5, 20, 30]
    for e in range(4):
        rows = slice(ends[e], ends[e + 1])
        torch.testing.assert_close(
            w.grad[e],
            (g[rows].t().float() @ xb[rows].float()).t(),
            rtol=1e-2,
            atol=1e-2,
        )
        expected_x = fp8.dequantize(*fp8.quantize(g[rows], 1)) @ wt[e].t()
        torch.testing.assert_close(x.grad[rows], expected_x, rtol=2e-2, atol=2e-2)
    assert torch.equal(w.grad[1], torch.zeros(64, 32))


def test_weights_are_quantized_once_per_version():
    w = torch.randn(32, 64, requires_grad=True)
    calls = []

    def make(t):
        calls.append(1)
        return fp8.quantize(t, 1)

    first = fp8.cached_per_version(w, "rows", make)
    assert fp8.cached_per_version(w, "rows", make) is first and len(calls) == 1
    with torch.no_grad():
        w.mul_(2)  # what an optimizer step does: an in-place update
    second = fp8.cached_per_version(w, "rows", make)
    assert len(calls) == 2 and torch.equal(second[1], first[1] * 2)


def test_both_expert_layouts_in_one_pass_equal_each_quantized_alone():
    torch.manual_seed(8)
    for w in (torch.randn(3, 40, 24) * 0.05, (torch.randn(2, 16, 48) * 3).to(torch.bfloat16)):
        w[0, :, 5] = 0  # an all-zero column and row: their own scales, zero codes
        w[1, 7, :] = 0
        forward = fp8._expert_codes(w, 1, with_other_layout=True)
        assert ("experts", 2) in fp8._cache_entries(w)  # made in the same pass, for the backward
        backward = fp8._expert_codes(w, 2)
        for (codes, inverse), alone in ((forward, fp8._one_expert_layout(w, 1)), (backward, fp8._one_expert_layout(w, 2))):
            assert codes.shape == alone[0].shape and codes.is_contiguous()
            assert torch.equal(codes.view(torch.uint8), alone[0].view(torch.uint8))
            assert torch.equal(inverse, alone[1])


def test_a_fused_optimizer_step_drops_the_cached_codes():
    """Fused AdamW updates in place without bumping the version: the step hook must forget."""
    w = torch.nn.Parameter(torch.randn(32, 64))
    optimizer = torch.optim.AdamW([w], lr=0.5, fused=True)
    fp8.forget_quantized_after_each_step(optimizer)
    before = fp8.cached_per_version(w, "rows", lambda t: fp8.quantize(t, 1))
    version = w._version
    w.grad = torch.randn_like(w)
    optimizer.step()
    after = fp8.cached_per_version(w, "rows", lambda t: fp8.quantize(t, 1))
    assert after is not before
    torch.testing.assert_close(fp8.dequantize(*after), w.detach(), rtol=2**-4, atol=0)
    assert w._version == version  # why the hook exists


def test_build_optimizer_installs_the_hook():
    model = torch.nn.Linear(64, 32, bias=False)
    optimizer = build_optimizer(
        model,
        argparse.Namespace(weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8, lr=0.1),
    )
    first = fp8.cached_per_version(model.weight, "rows", lambda t: fp8.quantize(t, 1))
    model.weight.grad = torch.ones_like(model.weight)
    optimizer.step()
    assert fp8.cached_per_version(model.weight, "rows", lambda t: fp8.quantize(t, 1)) is not first


def _tiny_llm(**overrides) -> MoELM:
    fields = {
        "vocab_size": 96,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "dense_ffn_dim": 128,
        "max_seq_len": 64,
        "moe": MoEConfig(num_experts=4, top_k=2, expert_dim=32, shared_expert_dim=32),
    }
    torch.manual_seed(0)
    model = MoELM(LLMConfig(**{**fields, **overrides}))
    with torch.no_grad():  # the weights the float8 bounds below were measured on: w1 then w3, drawn
        for module in model.modules():  # as two weights, whose draws fill w13 in that order
            if isinstance(module, MoELayer):
                w1_EDF, w3_EDF = module.w13_ED2F.flatten().chunk(2)
                shape = (*module.w13_ED2F.shape[:2], -1)
                module.w13_ED2F.copy_(interleave_gate_up(w1_EDF.view(shape), w3_EDF.view(shape)))
    return model


def test_conversion_keeps_parameters_and_skips_router_head_and_embeddings():
    model = _tiny_llm()
    before = dict(model.named_parameters())
    convert_to_fp8(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    converted = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert "layers.0.attention.wq" in converted and "layers.1.feed_forward.shared_expert.w2" in converted
    assert not any("router" in n or "output" in n for n in converted)
    assert isinstance(model.layers[1].feed_forward.grouped_swiglu, Float8GroupedSwiGLU)


def test_a_float8_training_step_stays_close_to_the_bf16_one():
    bf16, f8 = _tiny_llm(), convert_to_fp8(_tiny_llm())
    ids, targets = torch.randint(96, (2, 32)), torch.randint(96, (2, 32))
    positions, rows = torch.arange(2, 6), torch.randn(4, 64)
    losses = []
    for model in (bf16, f8):
        with bf16_autocast():
            logits, aux = model(ids, rows, positions)
            loss = model.loss_sum(logits, targets) / ids.numel() + aux
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    for (name, a), (_, b) in zip(bf16.named_parameters(), f8.named_parameters()):
        if a.grad is not None and a.grad.norm() > 0:
            assert relative_error(b.grad, a.grad) < 0.15, name


def test_config_names_what_fp8_needs():
    with pytest.raises(ValueError, match="llm.fp8 needs train.dtype 'bfloat16'"):
        config_lib.resolve(config_lib.load(None, ["llm.fp8=true"]), vocab_size=32)
    tp2 = ["llm.fp8=true", "train.dtype=bfloat16", "parallel.llm.tp=2"]
    with pytest.raises(ValueError, match="llm.fp8 needs parallel.llm.tp == 1"):
        config_lib.resolve(config_lib.load(None, tp2), vocab_size=32)


def test_misaligned_dims_are_refused_with_the_fields_to_change():
    model = _tiny_llm(dense_ffn_dim=100)
    with pytest.raises(ValueError, match="llm.dense_ffn_dim"):
        convert_to_fp8(model)


def test_dict_state_of_a_converted_model_loads_into_a_plain_one():
    f8 = convert_to_fp8(_tiny_llm())
    plain = _tiny_llm()
    plain.load_state_dict(copy.deepcopy(f8.state_dict()))


needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="no CUDA device of compute capability 9.0+ here: the float8 CUDA kernels are not exercised",
)


@needs_sm90
def test_cuda_grouped_kernel_matches_the_reference():
    torch.manual_seed(4)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 512, 256, device="cuda") * 0.05
    counts = torch.tensor([0, 700, 300, 1000, 96, 1200, 0, 800])
    offs = counts.cumsum(0).to(torch.int32).cuda()
    with bf16_autocast("cuda"):
        y, reference = (
            fp8.fp8_grouped_mm(x, w, offs),
            fp8.grouped_mm_reference(x, w, offs),
        )
    torch.testing.assert_close(y, reference, rtol=2e-2, atol=2e-2)


@needs_sm90
def test_cuda_linear_kernel_matches_the_reference():
    torch.manual_seed(5)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 1024, device="cuda") * 0.05
    with bf16_autocast("cuda"):
        y, reference = fp8.fp8_linear(x, w), fp8.linear_reference(x, w)
    torch.testing.assert_close(y, reference, rtol=2e-2, atol=2e-2)


@needs_sm90
def test_cuda_grouped_gradients_match_the_reference():
    torch.manual_seed(6)
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4, 256, 512, device="cuda") * 0.05).requires_grad_()
    offs = torch.tensor([512, 512, 1536, 2048], dtype=torch.int32, device="cuda")
    grad = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    with bf16_autocast("cuda"):
        y = fp8.fp8_grouped_mm(x, w, offs)
    y.backward(grad)
    wt = fp8.dequantize(*fp8.quantize(w.detach(), 2))
    g_codes = fp8.dequantize(*fp8.quantize(grad, 1))
    ends = [0, *offs.tolist()]
    for e in range(4):
        rows = slice(ends[e], ends[e + 1])
        torch.testing.assert_close(x.grad[rows].float(), g_codes[rows] @ wt[e].t(), rtol=2e-2, atol=2e-2)
        expected_w = x.detach()[rows].float().t() @ grad[rows].float()
        torch.testing.assert_close(w.grad[e], expected_w, rtol=2e-2, atol=5e-2)


@needs_sm90
def test_compiled_quantization_is_bitwise_the_eager_one():
    torch.manual_seed(7)
    compiled = torch.compile(fp8.quantize, dynamic=True)
    for t, dim in (
        (torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16), 1),
        (torch.randn(4, 256, 512, device="cuda"), 1),
        (torch.randn(4, 256, 512, device="cuda"), 2),
    ):
        codes, inverse = compiled(t, dim)
        expected_codes, expected_inverse = fp8.quantize(t, dim)
        assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
        assert torch.equal(inverse, expected_inverse)


def test_a_disaggregated_job_trains_with_llm_fp8(tmp_path):
    """llm.fp8 reaches the LLM pool's model through the config (CPU: dequantized codes)."""
    import dataclasses
    import math

    from tests.helpers.resilience import run_in_process

    overrides = [
        "llm.fp8=true",
        "train.dtype=bfloat16",
        "train.steps=4",
        "train.warmup_steps=1",
        "parallel.llm.dp=2",
        "parallel.llm.ep=2",
        "train.global_batch=8",
    ]
    config = dataclasses.replace(config_lib.load(None, overrides), out_dir=str(tmp_path / "run"))
    from dyad.service import build_model

    resolved = config_lib.resolve(config, vocab_size=64)
    assert isinstance(build_model(resolved, "llm", "cpu").layers[0].attention.wq, Fp8Linear)
    job = run_in_process(config)
    assert job.succeeded, job.info.message
    losses = [m["loss"] for m in job.metrics]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)


@needs_sm90
def test_cuda_both_layouts_kernel_is_bitwise_its_reference():
    from dyad.kernels import fp8_layouts

    assert fp8_layouts._kernel() is not None, "Triton missing: the fast path would not run"
    torch.manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(3, 200, 300, device="cuda") * 0.05).to(dtype)  # dims not multiples of the tiles
        w[2, :, 17] = 0
        scales = fp8._power_of_two_scales(w, 2), fp8._power_of_two_scales(w, 1)
        fast = fp8_layouts.scale_into_both_layouts(w, *scales)
        reference = fp8_layouts.scale_into_both_layouts_reference(w, *scales)
        for got, expected in zip(fast, reference):
            assert got.shape == expected.shape
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
