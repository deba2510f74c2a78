"""The router's fused kernels (logits; softmax top-k gates) agree with their plain-PyTorch
references, forward and backward; the references compute what the layer's general routing does."""

import pytest
import torch

from dyad.kernels import moe_router
from dyad.llm_service.config import MoEConfig
from dyad.llm_service.moe import MoELayer


def _layer(**options) -> MoELayer:
    return MoELayer(16, MoEConfig(num_experts=8, expert_dim=8, **({"top_k": 2} | options)))


@pytest.mark.parametrize("options", [{}, {"norm_topk_prob": False}, {"expert_bias": True}, {"top_k": 3}])
def test_the_softmax_top_k_reference_is_the_general_routing(options):
    torch.manual_seed(0)
    layer = _layer(**options)
    if layer.expert_bias_E is not None:
        layer.expert_bias_E.copy_(torch.randn(8) * 0.1)
    logits_TE = torch.randn(50, 8)
    got = moe_router.softmax_topk_reference(logits_TE, layer.cfg.top_k, layer.expert_bias_E, layer.cfg.norm_topk_prob)
    for a, b in zip(got, layer._select(logits_TE)):
        assert torch.equal(a, b)


def test_off_cuda_the_router_runs_the_references():
    torch.manual_seed(1)
    x_TD, w_ED = torch.randn(20, 16, dtype=torch.bfloat16), torch.randn(8, 16)
    assert torch.equal(moe_router.router_logits(x_TD, w_ED), moe_router.router_logits_reference(x_TD, w_ED))
    logits_TE = torch.randn(20, 8)
    for a, b in zip(moe_router.softmax_topk(logits_TE, 2), moe_router.softmax_topk_reference(logits_TE, 2)):
        assert torch.equal(a, b)
    routed = moe_router.route_softmax_topk(x_TD, w_ED, 2)
    for a, b in zip(routed, moe_router.softmax_topk_reference(moe_router.router_logits_reference(x_TD, w_ED), 2)):
        assert torch.equal(a, b)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the fused router kernels are not exercised"
)


def _logits_and_grads(fn, x_TD, w_ED, grad_TE):
    x_TD, w_ED = x_TD.clone().requires_grad_(), w_ED.clone().requires_grad_()
    logits_TE = fn(x_TD, w_ED)
    logits_TE.backward(grad_TE)
    return logits_TE.detach(), x_TD.grad, w_ED.grad, logits_TE.grad_fn


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_cuda
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, D, E", [(1031, 200, 8), (300, 2048, 128), (70, 96, 5), (16384, 4096, 8)])
def test_cuda_router_logits_agree_with_the_float32_reference(weight_dtype, T, D, E):
    """Both compute in float32 from the same operands; only the order of the sums differs. The
    last shape has long sums both ways (4,096 per logit, 2,048 rows per split of the weight
    gradient): summed whole inside the tensor cores' accumulator they were several times outside
    these bounds (dyad/kernels/moe_router_triton.py says why the kernels sum in chunks)."""
    assert moe_router._kernels() is not None, "Triton missing: the fused path would not run"
    torch.manual_seed(2)
    x_TD = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    w_ED = (torch.randn(E, D, device="cuda") * 0.05).to(weight_dtype)
    grad_TE = torch.randn(T, E, device="cuda")
    fast = _logits_and_grads(moe_router.router_logits, x_TD, w_ED, grad_TE)
    reference = _logits_and_grads(moe_router.router_logits_reference, x_TD, w_ED, grad_TE)
    assert "RouterLogits" in type(fast[3]).__name__, "the fused path did not run"
    assert fast[0].dtype == torch.float32 and fast[1].dtype == x_TD.dtype and fast[2].dtype == weight_dtype
    assert _relative(fast[0], reference[0]) < 1e-6, "logits"
    # Rounded once to bf16 by both, from float32 sums that differ only in their order: almost
    # every element is bitwise the same.
    _assert_rounded_alike(fast[1], reference[1], "grad x")
    if weight_dtype == torch.float32:
        assert _relative(fast[2], reference[2]) < 1e-6, "grad w"
    else:
        _assert_rounded_alike(fast[2], reference[2], "grad w")


def _assert_rounded_alike(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    assert got.dtype == expected.dtype
    assert (got == expected).float().mean().item() > 0.99, f"{name}: not rounded as the reference"
    assert _relative(got, expected) < torch.finfo(got.dtype).eps, name


def _routing_and_grads(fn, logits_TE, k, bias_E, normalize, grad_scores_TE, grad_gates_TK):
    logits_TE = logits_TE.clone().requires_grad_()
    scores_TE, gates_TK, expert_idx_TK = fn(logits_TE, k, bias_E, normalize)
    torch.autograd.backward([scores_TE, gates_TK], [grad_scores_TE, grad_gates_TK])
    return scores_TE.detach(), gates_TK.detach(), expert_idx_TK, logits_TE.grad, gates_TK.grad_fn


@needs_cuda
@pytest.mark.parametrize("E, k", [(8, 2), (128, 8), (6, 3), (8, 1), (256, 4), (5, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_cuda_softmax_top_k_agrees_with_the_reference(E, k, with_bias, normalize):
    assert moe_router._kernels() is not None, "Triton missing: the fused path would not run"
    torch.manual_seed(3)
    T = 1000  # not a multiple of the block
    logits_TE = torch.randn(T, E, device="cuda") * 3
    logits_TE[0] = 0.0  # every expert tied: the lowest k indices win
    bias_E = torch.randn(E, device="cuda") * 0.05 if with_bias else None
    grads = torch.randn(T, E, device="cuda"), torch.randn(T, k, device="cuda")
    fast = _routing_and_grads(moe_router.softmax_topk, logits_TE, k, bias_E, normalize, *grads)
    reference = _routing_and_grads(moe_router.softmax_topk_reference, logits_TE, k, bias_E, normalize, *grads)
    assert "SoftmaxTopK" in type(fast[4]).__name__, "the fused path did not run"
    if not with_bias:
        assert fast[2][0].tolist() == list(range(k)), "ties go to the lower expert"
    assert torch.equal(fast[2], reference[2]), "chosen experts"
    for name, got, expected in zip(("scores", "gates", "expert_idx", "grad logits"), fast[:4], reference[:4]):
        if name != "expert_idx":
            assert _relative(got, expected) < 1e-6, name


def _route_and_grads(route, x_TD, w_ED, k, bias_E, normalize, grad_scores_TE, grad_gates_TK):
    x_TD, w_ED = x_TD.clone().requires_grad_(), w_ED.clone().requires_grad_()
    scores_TE, gates_TK, expert_idx_TK = route(x_TD, w_ED, k, bias_E, normalize)
    torch.autograd.backward([scores_TE, gates_TK], [grad_scores_TE, grad_gates_TK])
    return scores_TE.detach(), gates_TK.detach(), expert_idx_TK, x_TD.grad, w_ED.grad, gates_TK.grad_fn


def _two_launches(x_TD, w_ED, k, bias_E, normalize):
    return moe_router.softmax_topk(moe_router.router_logits(x_TD, w_ED), k, bias_E, normalize)


@needs_cuda
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T, D, E, k", [(1031, 200, 8, 2), (300, 2048, 128, 8), (70, 96, 5, 3), (16384, 4096, 8, 2)]
)
@pytest.mark.parametrize("with_bias, normalize", [(False, True), (True, False)])
def test_cuda_the_one_launch_route_is_the_two_kernels(weight_dtype, T, D, E, k, with_bias, normalize):
    """The logits in registers go through the same softmax top-k as the logits read back: the
    same experts, scores and gates within float32 rounding (the softmax's sums run over another
    register layout), and gradients as the two kernels' (the same backward kernels run from the
    logits' gradient)."""
    assert moe_router._kernels() is not None, "Triton missing: the fused path would not run"
    torch.manual_seed(4)
    x_TD = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    w_ED = (torch.randn(E, D, device="cuda") * 0.05).to(weight_dtype)
    bias_E = torch.randn(E, device="cuda") * 0.05 if with_bias else None
    grads = torch.randn(T, E, device="cuda"), torch.randn(T, k, device="cuda")
    one = _route_and_grads(moe_router.route_softmax_topk, x_TD, w_ED, k, bias_E, normalize, *grads)
    two = _route_and_grads(_two_launches, x_TD, w_ED, k, bias_E, normalize, *grads)
    assert "RouteSoftmaxTopK" in type(one[5]).__name__, "the one-launch path did not run"
    assert torch.equal(one[2], two[2]), "chosen experts"
    for name, got, expected in zip(("scores", "gates"), one[:2], two[:2]):
        assert _relative(got, expected) < 1e-6, name
    _assert_rounded_alike(one[3], two[3], "grad x")
    if weight_dtype == torch.float32:
        assert _relative(one[4], two[4]) < 1e-6, "grad w"
    else:
        _assert_rounded_alike(one[4], two[4], "grad w")


@needs_cuda
def test_cuda_the_moe_layer_routes_in_one_launch():
    layer = _layer().cuda()
    x_TD = torch.randn(40, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert "RouteSoftmaxTopK" in type(layer.route(x_TD)[1].grad_fn).__name__


@needs_cuda
def test_cuda_float32_activations_take_the_reference():
    x_TD = torch.randn(4, 16, device="cuda", requires_grad=True)
    assert "RouterLogits" not in type(moe_router.router_logits(x_TD, torch.randn(8, 16, device="cuda")).grad_fn).__name__


@needs_cuda
def test_cuda_zero_tokens_route_to_nothing():
    """A rank with no tokens gets empty results (the kernels are not launched on an empty grid)."""
    x_TD = torch.randn(0, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits_TE = moe_router.router_logits(x_TD, torch.randn(8, 16, device="cuda"))
    scores_TE, gates_TK, expert_idx_TK = moe_router.softmax_topk(logits_TE, 2)
    assert logits_TE.shape == scores_TE.shape == (0, 8) and gates_TK.shape == expert_idx_TK.shape == (0, 2)
    (scores_TE.sum() + gates_TK.sum()).backward()
    assert x_TD.grad.shape == (0, 16)
    routed = moe_router.route_softmax_topk(x_TD, torch.randn(8, 16, device="cuda"), 2)
    assert routed[0].shape == (0, 8) and routed[1].shape == routed[2].shape == (0, 2)
