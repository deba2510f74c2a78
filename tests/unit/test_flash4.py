"""FlashAttention-4 (flash-attn-4, where installed on a Hopper or Blackwell GPU) against the plain
attention it replaces: variable-length segments (the vision tower's images, packed samples), whole
causal sequences (the LLM), grouped-query heads, head dims that are no power of two, and inside a
compiled graph. On the CPU only the ops' shapes (what a compiled caller's graph is traced with)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from dyad.kernels import flash4
from dyad.kernels import varlen_attention as varlen


def _flash4_here() -> bool:
    if not torch.cuda.is_available():
        return False
    probe = torch.empty(1, 2, 64, device="cuda", dtype=torch.bfloat16)
    return flash4.flash4_applies(probe, probe, probe)


needs_flash4 = pytest.mark.skipif(not _flash4_here(), reason="no CUDA device with flash-attn-4 here (Hopper or "
                                  "Blackwell, `pip install dyad[flash4]`): FlashAttention-4 is not exercised")


def test_the_ops_shapes_as_a_compiled_graph_sees_them():
    with FakeTensorMode():
        q, k, v = torch.empty(40, 4, 72), torch.empty(40, 2, 72), torch.empty(40, 2, 64)
        cu = torch.empty(4, dtype=torch.int32)
        out, lse = torch.ops.dyad.flash4_attention(q, k, v, cu, 24, 0.1, False)
        assert (tuple(out.shape), tuple(lse.shape), lse.dtype) == ((40, 4, 64), (4, 40), torch.float32)
        q, k = torch.empty(2, 16, 8, 128), torch.empty(2, 16, 2, 128)
        out, lse = torch.ops.dyad.flash4_attention(q, k, k, None, 16, 0.1, True)
        assert (tuple(out.shape), tuple(lse.shape)) == ((2, 16, 8, 128), (2, 8, 16))
        grads = torch.ops.dyad.flash4_attention_backward(out, q, k, k, out, lse, None, 16, 0.1, True)
        assert [tuple(g.shape) for g in grads] == [(2, 16, 8, 128), (2, 16, 2, 128), (2, 16, 2, 128)]


def test_it_is_not_chosen_off_the_gpu_or_in_float32():
    x = torch.randn(8, 2, 64)
    assert not flash4.flash4_applies(x, x, x)
    if torch.cuda.is_available():
        assert not flash4.flash4_applies(*(x.cuda(),) * 3)


@needs_flash4
def test_grouped_heads_with_their_own_value_dim_are_left_to_sdpa():
    q, k, v = (torch.empty(4, n, d, device="cuda", dtype=torch.bfloat16) for n, d in ((8, 192), (2, 192), (2, 128)))
    assert not flash4.flash4_applies(q, k, v)
    assert flash4.flash4_applies(q, k[:, :1].expand(4, 8, 192), v[:, :1].expand(4, 8, 128))


def _compare(attend, reference, shapes, scale=None):
    torch.manual_seed(0)
    q, k, v = (torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes)
    upstream = torch.randn(*shapes[0][:-1], shapes[2][-1], device="cuda", dtype=torch.bfloat16)
    results = []
    for way in (attend, reference):
        out = way(q, k, v)
        results.append((out, *torch.autograd.grad((out.float() * upstream).sum(), (q, k, v))))
    for name, got, expected in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2, msg=name)


@needs_flash4
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(16, 16, 72), (8, 2, 64), (4, 4, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_variable_length_segments_match_the_reference(heads, kv_heads, head_dim, causal):
    lengths = [24, 256, 24, 8, 100]
    bounds = varlen.segment_bounds(lengths, "cuda")
    R = sum(lengths)

    def reference(q, k, v):
        return varlen.varlen_attention_reference(q.float(), k.float(), v.float(), lengths, causal=causal).to(q.dtype)

    _compare(lambda q, k, v: varlen.varlen_attention(q, k, v, *bounds, causal=causal), reference,
             [(R, heads, head_dim), (R, kv_heads, head_dim), (R, kv_heads, head_dim)])


@needs_flash4
@pytest.mark.parametrize("heads, kv_heads, head_dim, value_dim", [(8, 2, 128, 128), (8, 8, 192, 128)])
def test_whole_causal_sequences_match_sdpa(heads, kv_heads, head_dim, value_dim):
    def reference(q, k, v):
        q_, k_, v_ = (x.float().transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True).transpose(1, 2).to(q.dtype)

    _compare(lambda q, k, v: flash4.flash4_attention(q, k, v, causal=True), reference,
             [(2, 384, heads, head_dim), (2, 384, kv_heads, head_dim), (2, 384, kv_heads, value_dim)])


@needs_flash4
def test_a_compiled_graph_calls_the_kernels_without_breaking():
    lengths = [64, 200, 36]
    bounds = varlen.segment_bounds(lengths, "cuda")
    R = sum(lengths)

    def attend(q, k, v, cu_seqlens):
        return varlen.varlen_attention(q * 1.0, k, v, cu_seqlens, bounds[1], scale=0.1)

    compiled = torch.compile(attend, fullgraph=True)
    _compare(lambda q, k, v: compiled(q, k, v, bounds[0]), lambda q, k, v: attend(q, k, v, bounds[0]),
             [(R, 16, 72), (R, 16, 72), (R, 16, 72)])


@needs_flash4
def test_the_llms_causal_attention_takes_it_and_matches_sdpa(monkeypatch):
    from dyad.llm_service import model

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flash4.flash4_attention(*args, **kwargs)

    monkeypatch.setattr(model, "flash4_attention", counted)
    core = model.CausalAttention()

    def sdpa_only(q, k, v):
        flash4.FLASH4["enabled"] = False
        try:
            return core(q, k, v, positions_S=None)
        finally:
            flash4.FLASH4["enabled"] = True

    # [B, heads, S, Dh], as the decoder's attention hands them over
    _compare(lambda q, k, v: core(q, k, v, positions_S=None), sdpa_only,
             [(2, 8, 384, 128), (2, 2, 384, 128), (2, 2, 384, 128)])
    assert len(calls) == 1
