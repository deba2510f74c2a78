"""The experts' one gate-up weight (w13_ED2F, whose column pairs are (gate, up)) computes the
function of SwiGLU experts with w1 and w3 as two weights, and its fused GEMMs
(dyad/kernels/gated_experts.py, QuACK on Hopper GPUs) agree with the plain path."""

import dataclasses
import functools

import pytest
import torch
from torch import nn

from dyad.kernels import fp8
from dyad.kernels.expert_weight_grads import expert_grouped_mm
from dyad.kernels.gated_experts import gated_experts, gated_experts_reference, gated_up_projection
from dyad.kernels.grouped_mm import grouped_mm
from dyad.kernels.swiglu import swiglu
from dyad.llm_service.config import MoEConfig
from dyad.llm_service.fp8 import Float8GroupedSwiGLU, convert_to_fp8
from dyad.llm_service.moe import MoELayer
from tests.helpers.experts import gate_and_up
from tests.helpers.parity import relative_error

CFG = MoEConfig(num_experts=4, top_k=2, expert_dim=24, aux_loss_coef=0.01)
DIM = 16


class _TwoWeightsLayer(MoELayer):
    """The reference: the layer with w1 and w3 as two weights, each up-projection its own grouped
    GEMM (`matmul`), SwiGLU of the two."""

    def __init__(self, layer: MoELayer, matmul=expert_grouped_mm):
        super().__init__(layer.router.in_features, layer.cfg)
        w1_EDF, w3_EDF = gate_and_up(layer)
        del self.w13_ED2F
        self.w1_EDF, self.w3_EDF = (nn.Parameter(w.detach().clone()) for w in (w1_EDF, w3_EDF))
        with torch.no_grad():
            self.router.weight.copy_(layer.router.weight)
            self.w2_EFD.copy_(layer.w2_EFD)
        self.matmul = matmul

    def experts(self, x_sorted_ND, counts_E):
        offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        h1_NF = self.matmul(x_sorted_ND, self.w1_EDF, offs_E)
        h3_NF = self.matmul(x_sorted_ND, self.w3_EDF, offs_E)
        return self.matmul(swiglu(h1_NF, h3_NF), self.w2_EFD, offs_E)


def _layers(cfg: MoEConfig = CFG, dim: int = DIM, matmul=expert_grouped_mm) -> tuple[MoELayer, MoELayer]:
    """A two-weights layer (the reference, by `matmul`) and the layer with the same weights."""
    torch.manual_seed(0)
    interleaved = MoELayer(dim, cfg)
    return _TwoWeightsLayer(interleaved, matmul), interleaved


def _step(layer: MoELayer, x_TD: torch.Tensor, upstream_TD: torch.Tensor):
    x_TD = x_TD.clone().requires_grad_()
    y_TD, aux = layer(x_TD)
    ((y_TD * upstream_TD).sum() + aux).backward()
    return y_TD.detach(), aux.detach(), x_TD.grad


def test_interleaved_weights_compute_the_separate_layers_function():
    separate, interleaved = _layers()
    x_TD, upstream_TD = torch.randn(40, DIM), torch.randn(40, DIM)
    for got, want in zip(_step(interleaved, x_TD, upstream_TD), _step(separate, x_TD, upstream_TD)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    gate_grad, up_grad = interleaved.w13_ED2F.grad[..., 0::2], interleaved.w13_ED2F.grad[..., 1::2]
    torch.testing.assert_close(gate_grad, separate.w1_EDF.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(up_grad, separate.w3_EDF.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(interleaved.w2_EFD.grad, separate.w2_EFD.grad, rtol=1e-6, atol=1e-7)


def test_float8_interleaved_computes_float8_two_weights_but_for_one_scale_per_row_in_dx():
    """Float8 quantizes a weight per output column for the forward, so (gate, up) pairs get the
    scales two weights get: same outputs, same weight gradients. The input gradient contracts
    over w13's 2F columns with one scale per row where two weights have one per F: it differs,
    by a small part of float8's own error against bf16."""
    cfg = dataclasses.replace(CFG, expert_dim=32)  # float8 GEMMs need dims divisible by 16
    separate, interleaved = _layers(cfg, dim=32, matmul=fp8.fp8_grouped_mm)
    bf16 = _TwoWeightsLayer(interleaved)
    convert_to_fp8(interleaved)
    assert isinstance(interleaved.grouped_swiglu, Float8GroupedSwiGLU)
    x_TD, upstream_TD = torch.randn(64, 32), torch.randn(64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (y, aux, dx), (y_sep, aux_sep, dx_sep) = (_step(m, x_TD, upstream_TD) for m in (interleaved, separate))
        _, _, dx_bf16 = _step(bf16, x_TD, upstream_TD)
    torch.testing.assert_close(y, y_sep, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(aux, aux_sep, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(interleaved.w13_ED2F.grad[..., 0::2], separate.w1_EDF.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(interleaved.w13_ED2F.grad[..., 1::2], separate.w3_EDF.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(interleaved.w2_EFD.grad, separate.w2_EFD.grad, rtol=1e-6, atol=1e-7)
    float8_error = relative_error(dx_sep, dx_bf16, norm="fro")  # about 0.06 here
    assert 0 < relative_error(dx, dx_sep, norm="fro") < float8_error / 10


def test_the_interleaved_layer_names_its_expert_weights():
    _, interleaved = _layers()
    assert interleaved.expert_weight_names() == ["w13_ED2F", "w2_EFD"]
    assert interleaved.w13_ED2F.shape == (4, DIM, 48)
    assert not hasattr(interleaved, "w1_EDF")


def _fused_available() -> str | None:
    """Why the fused GEMMs cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] != 9:
        return "QuACK's fused GEMMs are used on Hopper (sm90) GPUs only"
    try:
        import quack.gemm_interface  # noqa: F401
    except ImportError as err:
        return f"QuACK is not installed ({err})"
    return None


def _expert_operands(counts, D=256, F=384):
    """(offs_E, x, w13, w2, upstream) in bf16 on the GPU for experts of `counts` rows, seed 0."""
    torch.manual_seed(0)
    offs_E = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), D, device="cuda", dtype=torch.bfloat16)
    w13 = (torch.randn(len(counts), D, 2 * F, device="cuda") * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(len(counts), F, D, device="cuda") * 0.05).to(torch.bfloat16)
    upstream = torch.randn(sum(counts), D, device="cuda", dtype=torch.bfloat16)
    return offs_E, x, w13, w2, upstream


@pytest.mark.skipif(_fused_available() is not None, reason=str(_fused_available()))
@pytest.mark.parametrize("autotune", [False, True])
def test_cuda_fused_gate_gemms_agree_with_the_plain_path(autotune):
    """Output, input and weight gradients of the fused path (QuACK's default tiles, or those its
    autotuner picks) and of the plain bf16 path, each against float32 math of the same bf16
    values: both within bf16's error."""
    offs_E, x, w13, w2, upstream = _expert_operands([300, 0, 129, 211])

    def run(fn, dtype):
        xi, w13i, w2i = (t.to(dtype).clone().requires_grad_() for t in (x, w13, w2))
        y = fn(xi, w13i, w2i, offs_E, grouped_mm)
        y.backward(upstream.to(dtype))
        torch.cuda.synchronize()
        return [t.float() for t in (y, xi.grad, w13i.grad, w2i.grad)]

    exact = run(gated_experts_reference, torch.float32)
    fused = run(functools.partial(gated_experts, autotune=autotune), torch.bfloat16)
    plain = run(gated_experts_reference, torch.bfloat16)
    for name, f, p, e in zip(("output", "input grad", "w13 grad", "w2 grad"), fused, plain, exact):
        fused_err, plain_err = ((f - e).norm() / e.norm()).item(), ((p - e).norm() / e.norm()).item()
        assert fused_err < 1e-2 and plain_err < 1e-2, f"{name}: fused {fused_err:.2e}, plain {plain_err:.2e}"
        assert fused_err < 2 * plain_err, f"{name}: fused {fused_err:.2e} against plain {plain_err:.2e}"


@pytest.mark.skipif(_fused_available() is not None, reason=str(_fused_available()))
@pytest.mark.parametrize("counts", [[300, 0, 129, 211], [64, 64, 64, 64], [0, 0, 5, 0]])
def test_cuda_prepared_up_projection_is_gemm_act_bit_for_bit(counts):
    """The forward GEMM through QuACK's prepared launch writes what `gemm_act` writes, on the
    first call of a shape (which prepares it) and on the next (which reuses it)."""
    from quack.gemm_interface import gemm_act

    torch.manual_seed(len(counts) + sum(counts))
    E, D, F = len(counts), 256, 384
    starts_E1 = torch.tensor([0] + counts, device="cuda").cumsum(0).to(torch.int32)
    w13 = (torch.randn(E, D, 2 * F, device="cuda") * 0.05).to(torch.bfloat16)
    for _ in range(2):
        x = torch.randn(sum(counts), D, device="cuda", dtype=torch.bfloat16)
        h13, g = gated_up_projection(x, w13, starts_E1)
        h13_ref, g_ref = gemm_act(x, w13, activation="swiglu", cu_seqlens_m=starts_E1, tuned=False)
        assert torch.equal(h13, h13_ref)
        assert torch.equal(g, g_ref)


@pytest.mark.skipif(_fused_available() is not None, reason=str(_fused_available()))
def test_cuda_fused_path_adds_weight_gradients_when_its_input_needs_none():
    """A layer whose input needs no gradient (frozen layers before it, a data tensor) still gets
    its expert weights' gradients from the fused path, those of the plain path within bf16."""
    offs_E, x, w13, w2, upstream = _expert_operands([100, 3, 0, 153])
    grads = []
    for fn in (gated_experts, gated_experts_reference):
        w13i, w2i = w13.clone().requires_grad_(), w2.clone().requires_grad_()
        fn(x, w13i, w2i, offs_E, grouped_mm).backward(upstream)
        torch.cuda.synchronize()
        grads.append((w13i.grad, w2i.grad))
    for name, fused, plain in zip(("w13", "w2"), *grads):
        assert fused is not None, f"{name}: no gradient from the fused path"
        assert relative_error(fused.float(), plain.float(), norm="fro") < 1e-2, name
