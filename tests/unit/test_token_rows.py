"""The fused per-token gather-reduce kernels agree with their plain-PyTorch references."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dyad.kernels import token_rows

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the fused token-row kernels are not exercised"
)
SHAPES = [(300, 2, 4103), (257, 8, 2048), (100, 6, 1000)]  # K not a power of two; D not a block multiple


def _operands(T, K, D, dtype, device="cuda"):
    torch.manual_seed(T + K + D)
    rows_ND = torch.randn(T * K, D, device=device).to(dtype)
    positions_TK = torch.randperm(T * K, device=device).view(T, K)
    weights_TK = torch.rand(T, K, device=device)  # float32, as the router's gates are
    grad_TD = torch.randn(T, D, device=device).to(dtype)
    return rows_ND, positions_TK, weights_TK, grad_TD


def _assert_agree(got, expected, magnitudes, terms, what):
    """Both sides sum the same float32 terms in another order and round once to the dtype: each
    element within one unit in the last place of the dtype plus the float32 summation bound of
    two sums of `terms` terms, 2 * terms * eps32 * sum |term| (`magnitudes`)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    expected32, magnitudes32 = expected.float(), magnitudes.float()
    bound = torch.finfo(expected.dtype).eps * expected32.abs() + 2 * terms * torch.finfo(torch.float32).eps * magnitudes32
    excess = ((got.float() - expected32).abs() - bound - 1e-30).max().item()
    assert excess <= 0, f"{what}: differs by {excess:g} beyond one rounding"


def test_off_cuda_the_references_run():
    rows_ND, positions_TK, weights_TK, grad_TD = _operands(5, 3, 7, torch.float32, device="cpu")
    assert not token_rows._fused_applies(rows_ND, positions_TK)
    expected = torch.stack([(rows_ND[positions_TK[t]] * weights_TK[t, :, None]).sum(0) for t in range(5)])
    torch.testing.assert_close(token_rows.gathered_sum(rows_ND, positions_TK, weights_TK), expected)
    grad_rows, dots = token_rows.scaled_scatter_and_dots(grad_TD, rows_ND, positions_TK, weights_TK)
    for t in range(5):
        for k in range(3):
            torch.testing.assert_close(grad_rows[positions_TK[t, k]], weights_TK[t, k] * grad_TD[t])
            torch.testing.assert_close(dots[t, k], rows_ND[positions_TK[t, k]] @ grad_TD[t])


@needs_cuda
@pytest.mark.parametrize("T,K,D", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gathered_sum_agrees_with_the_reference(T, K, D, dtype):
    assert token_rows._kernels() is not None, "Triton missing: the fused path would not run"
    rows_ND, positions_TK, weights_TK, _ = _operands(T, K, D, dtype)
    assert token_rows._fused_applies(rows_ND, positions_TK)
    for weights in (weights_TK, None):
        got = token_rows.gathered_sum(rows_ND, positions_TK, weights)
        expected = token_rows.gathered_sum_reference(rows_ND, positions_TK, weights)
        abs_weights = None if weights is None else weights.abs()
        magnitudes = token_rows.gathered_sum_reference(rows_ND.abs(), positions_TK, abs_weights)
        _assert_agree(got, expected, magnitudes, K, f"gathered_sum, weighted={weights is not None}")


@needs_cuda
@pytest.mark.parametrize("T,K,D", SHAPES)
def test_cuda_gathered_sum_into_float32_agrees_with_the_reference(T, K, D):
    rows_ND, positions_TK, _, _ = _operands(T, K, D, torch.bfloat16)
    got = token_rows.gathered_sum(rows_ND, positions_TK, out_dtype=torch.float32)
    expected = token_rows.gathered_sum_reference(rows_ND, positions_TK, out_dtype=torch.float32)
    magnitudes = token_rows.gathered_sum_reference(rows_ND.abs(), positions_TK, out_dtype=torch.float32)
    _assert_agree(got, expected, magnitudes, K, "gathered_sum into float32")


@needs_cuda
@pytest.mark.parametrize("T,K,D", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_scaled_scatter_and_dots_agree_with_the_reference(T, K, D, dtype):
    rows_ND, positions_TK, weights_TK, grad_TD = _operands(T, K, D, dtype)
    grad_rows, dots = token_rows.scaled_scatter_and_dots(grad_TD, rows_ND, positions_TK, weights_TK)
    expected_rows, expected_dots = token_rows.scaled_scatter_and_dots_reference(
        grad_TD, rows_ND, positions_TK, weights_TK
    )
    assert torch.equal(grad_rows, expected_rows)  # one product, rounded once, either way
    _, magnitudes = token_rows.scaled_scatter_and_dots_reference(grad_TD.abs(), rows_ND.abs(), positions_TK, weights_TK)
    _assert_agree(dots, expected_dots, magnitudes, D, "dots")


@needs_cuda
def test_cuda_float32_takes_the_references():
    rows_ND, positions_TK, _, _ = _operands(4, 2, 8, torch.float32)
    assert not token_rows._fused_applies(rows_ND, positions_TK)


@needs_cuda
def test_cuda_compiled_callers_run_the_fused_kernels(monkeypatch):
    """Traced by torch.compile, the combine and its backward call the Triton kernels (as custom
    ops) and give the eager results bit for bit."""
    rows_ND, positions_TK, weights_TK, grad_TD = _operands(257, 8, 2048, torch.bfloat16)
    calls = []
    for name in ("_gathered_sum_fused", "_scaled_scatter_and_dots_fused"):
        kernel = getattr(token_rows, name)
        monkeypatch.setattr(token_rows, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))

    def both(rows, positions, weights, grad):
        return (token_rows.gathered_sum(rows, positions, weights), token_rows.gathered_sum(rows, positions, out_dtype=torch.float32),
                *token_rows.scaled_scatter_and_dots(grad, rows, positions, weights))

    eager = both(rows_ND, positions_TK, weights_TK, grad_TD)
    calls.clear()
    compiled = torch.compile(both, fullgraph=True)(rows_ND, positions_TK, weights_TK, grad_TD)
    assert sorted(calls) == ["_gathered_sum_fused", "_gathered_sum_fused", "_scaled_scatter_and_dots_fused"]
    for got, expected in zip(compiled, eager, strict=True):
        assert torch.equal(got, expected)


def _copies_operands(T, K, D, x_dtype):
    torch.manual_seed(T * K + D)
    order_N = torch.randperm(T * K, device="cuda")
    positions_TK = token_rows._order(order_N.view(T, K))  # the inverse of the order: each assignment's row
    x_TD = torch.randn(T, D, device="cuda").to(x_dtype)
    return x_TD, positions_TK.view(T, K), order_N


def test_the_copies_shapes_as_a_compiled_graph_sees_them():
    with FakeTensorMode():
        x_TD, positions_TK = torch.empty(5, 7), torch.empty(5, 3, dtype=torch.long)
        out = torch.ops.dyad.scattered_copies(x_TD, positions_TK, torch.bfloat16)
        assert (tuple(out.shape), out.dtype) == ((15, 7), torch.bfloat16)


def test_off_cuda_the_copies_are_the_gather():
    T, K, D = 6, 3, 5
    order_N = torch.randperm(T * K)
    x_TD = torch.randn(T, D)
    positions_TK = token_rows._order(order_N.view(T, K)).view(T, K)
    copies = token_rows.scattered_copies(x_TD, positions_TK, order_N, torch.float32)
    for t in range(T):
        for k in range(K):
            assert torch.equal(copies[positions_TK[t, k]], x_TD[t])


@needs_cuda
@pytest.mark.parametrize("T,K,D", SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_cuda_scattered_copies_are_the_reference_gather(T, K, D, x_dtype):
    """Each copy is the row, rounded once to bf16 where x is float32: bitwise the reference's,
    eager and compiled (as the custom op)."""
    x_TD, positions_TK, order_N = _copies_operands(T, K, D, x_dtype)
    expected = token_rows.scattered_copies_reference(x_TD, positions_TK, order_N, torch.bfloat16)
    eager = token_rows.scattered_copies(x_TD, positions_TK, order_N, torch.bfloat16)
    compiled = torch.compile(token_rows.scattered_copies, fullgraph=True)(x_TD, positions_TK, order_N, torch.bfloat16)
    assert torch.equal(eager, expected) and torch.equal(compiled, expected)


@needs_cuda
def test_cuda_compiled_permutation_copies_through_the_kernel(monkeypatch):
    """The MoE permutation, traced, scatters the copies with the kernel and gives eager's copies
    and x's gradient bit for bit."""
    from dyad.kernels import moe_permute

    calls = []
    kernel = token_rows._scattered_copies_fused
    monkeypatch.setattr(token_rows, "_scattered_copies_fused", lambda *a: calls.append(1) or kernel(*a))
    torch.manual_seed(5)
    T, K, E, D = 257, 8, 32, 2048
    x = torch.randn(T, D, device="cuda", requires_grad=True)
    expert_idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    upstream = torch.randn(T * K, D, device="cuda").to(torch.bfloat16)

    def copies_and_grad(x_TD):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x_sorted, _, _ = moe_permute.permute(x_TD, expert_idx, E)
        return x_sorted, torch.autograd.grad((x_sorted.float() * upstream.float()).sum(), x_TD)[0]

    eager = copies_and_grad(x)
    assert calls, "eager: the copies did not go through the kernel"
    calls.clear()
    compiled = torch.compile(copies_and_grad)(x)
    assert calls, "compiled: the copies did not go through the kernel"
    for got, expected in zip(compiled, eager, strict=True):
        assert torch.equal(got, expected)
