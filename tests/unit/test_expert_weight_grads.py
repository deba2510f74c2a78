"""Expert GEMMs that add their weight gradients into `.grad` themselves agree with autograd's."""

import pytest
import torch

from dyad.kernels import expert_weight_grads
from dyad.kernels.grouped_mm import grouped_mm

COUNTS = [5, 0, 300, 64]  # an expert without rows among them


def _two_backwards(matmul, w_dtype, autocast):
    """Output, x.grad and w.grad after two forward + backward passes (the second accumulates)."""
    torch.manual_seed(5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    offs = torch.tensor(COUNTS, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(sum(COUNTS), 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(COUNTS), 256, 512, device=device) * 0.05).to(w_dtype).requires_grad_(True)
    grads = torch.randn(2, sum(COUNTS), 512, device=device, dtype=torch.bfloat16)
    for grad in grads:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = matmul(x, w, offs)
        y.backward(grad)
    return y.detach(), x.grad, w.grad


def test_off_cuda_it_is_grouped_mm():
    x, w = torch.randn(6, 4), torch.randn(2, 4, 3, requires_grad=True)
    assert not expert_weight_grads._into_grad_applies(x, w, w)


class _Records(torch.autograd.Function):
    """Identity whose backward appends `name` to `events` and, with `join`, queues a join."""

    @staticmethod
    def forward(ctx, x, events, name, join):
        ctx.events, ctx.name, ctx.join = events, name, join
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append(ctx.name)
        if ctx.join:
            expert_weight_grads.join_when_backward_ends(lambda: ctx.events.append(f"joined after {ctx.name}"))
        return grad, None, None, None


def test_the_join_waits_for_the_end_of_the_backward_pass():
    events = []
    x = torch.ones(3, requires_grad=True)
    y = _Records.apply(_Records.apply(x, events, "first forward", False), events, "second forward", True)
    y.sum().backward()
    events.append("backward returned")
    # the second forward's backward runs first; the join after the whole pass, before it returns
    assert events == ["second forward", "first forward", "joined after second forward", "backward returned"]


def test_outside_a_backward_pass_the_join_is_at_once():
    events = []
    expert_weight_grads.join_when_backward_ends(lambda: events.append("joined"))
    assert events == ["joined"]


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="no CUDA device of compute capability 9.0+ here: grouped_mm's fast path and the fused weight-gradient GEMMs are not exercised",
)


@needs_cuda
@pytest.mark.parametrize("w_dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_cuda_weight_grads_added_by_the_gemm_agree_with_autograds(w_dtype, autocast):
    fused = _two_backwards(expert_weight_grads.expert_grouped_mm, w_dtype, autocast)
    plain = _two_backwards(grouped_mm, w_dtype, autocast)
    assert torch.equal(fused[0], plain[0]), "forward"
    torch.testing.assert_close(fused[1], plain[1], msg="input gradient")
    assert fused[2].dtype == w_dtype
    assert torch.all(fused[2][1] == 0), "an expert without rows gets a zero gradient"
    # autograd rounds each pass's gradient to bf16 before adding it; the GEMM adds it unrounded
    error = (fused[2].float() - plain[2].float()).norm() / plain[2].float().norm()
    assert error < 2**-8, f"weight gradient: relative error {error.item():.3g} beyond bf16 rounding"


@needs_cuda
def test_cuda_the_fused_path_runs_for_a_few_experts_and_not_for_many():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    few = torch.zeros(4, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    many = torch.zeros(expert_weight_grads.MAX_EXPERTS + 1, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert expert_weight_grads._into_grad_applies(x, few, few)
    assert not expert_weight_grads._into_grad_applies(x, many, many)
    offs = torch.tensor([16, 32, 48, 64], device="cuda")
    assert "GroupedMmIntoGrad" in type(expert_weight_grads.expert_grouped_mm(x, few, offs).grad_fn).__name__


@needs_cuda
def test_cuda_weight_grads_are_complete_on_the_current_stream_when_backward_returns():
    """Only the side streams have work here (no input gradient): a copy of `.grad` queued on the
    current stream right after `backward()` would see it half written without the join."""
    torch.manual_seed(0)
    experts, rows, dim, out = 4, 8192, 2048, 4096
    x = torch.randn(experts * rows, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, dim, out, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows
    y = expert_weight_grads.expert_grouped_mm(x, w, offs)
    torch.cuda.synchronize()
    y.backward(torch.randn_like(y))
    seen_at_return = w.grad.clone()
    torch.cuda.synchronize()
    assert torch.equal(seen_at_return, w.grad)


class _PlainExperts(torch.nn.Module):
    """A MoE layer's `grouped_swiglu` on the plain path (SwiGLU between the GEMMs, not in their
    epilogues), its grouped GEMMs by `matmul`."""

    def __init__(self, matmul):
        super().__init__()
        self.matmul = matmul

    def forward(self, x_sorted_ND, w13_ED2F, w2_EFD, offs_E):
        from dyad.kernels.gated_experts import gated_experts_reference

        return gated_experts_reference(x_sorted_ND, w13_ED2F, w2_EFD, offs_E, self.matmul)


def _layer_gradients(experts=None, dtype=None):
    """Every parameter's gradient of a float32 MoE layer (its `grouped_swiglu` replaced by
    `experts`, when given) after two microbatches (the second accumulating) under bf16 autocast,
    as training runs it; float32 math with `dtype` float32."""
    from dyad.llm_service.config import MoEConfig
    from dyad.llm_service.moe import MoELayer

    torch.manual_seed(3)
    cfg = MoEConfig(num_experts=4, top_k=2, expert_dim=512, aux_loss_coef=0.01)
    layer = MoELayer(256, cfg).cuda()
    if experts is not None:
        layer.grouped_swiglu = experts
    for microbatch in range(2):
        x = torch.randn(1024, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(microbatch))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is None):
            y, aux = layer(x)
        (y.float().square().mean() + aux).backward()
    return {name: p.grad for name, p in layer.named_parameters()}


@needs_cuda
def test_cuda_moe_layer_gradients_match_autograds_over_two_microbatches():
    """On the plain path (the GEMMs that add into `.grad` and nothing else changed): every
    parameter's gradient matches the layer with autograd's weight gradients within bf16 rounding."""
    fused = _layer_gradients(_PlainExperts(expert_weight_grads.expert_grouped_mm))
    plain = _layer_gradients(_PlainExperts(grouped_mm))
    assert fused.keys() == plain.keys()
    for name in fused:
        error = (fused[name] - plain[name]).norm() / plain[name].norm()
        assert error < 2**-8, f"{name}: relative error {error.item():.3g} beyond bf16 rounding"


@needs_cuda
def test_cuda_interleaved_moe_layer_gradients_over_two_microbatches():
    """The layer's own path, the input needing no gradient: every parameter gets one, and the
    layer's path (with QuACK installed, SwiGLU in the GEMMs' epilogues, its product rounded once)
    is within bf16 error of float32 math and no further from it than autograd's plain bf16 path."""
    fused = _layer_gradients()
    plain = _layer_gradients(_PlainExperts(grouped_mm))
    exact = _layer_gradients(_PlainExperts(grouped_mm), torch.float32)
    for name, e in exact.items():
        assert fused[name] is not None, f"{name}: no gradient"
        fused_err = ((fused[name] - e).norm() / e.norm()).item()
        plain_err = ((plain[name] - e).norm() / e.norm()).item()
        assert fused_err < 1e-2 and plain_err < 1e-2, f"{name}: fused {fused_err:.2e}, plain {plain_err:.2e}"
        assert fused_err < 2 * plain_err, f"{name}: fused {fused_err:.2e} against plain {plain_err:.2e}"
