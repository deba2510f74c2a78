"""Fast kernels agree with their plain-PyTorch references (CPU, float32)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dyad.kernels.grouped_mm import grouped_mm, grouped_mm_reference, supports_fast_path
from dyad.kernels.moe_permute import (
    expert_counts,
    expert_plan,
    inverse_permutation,
    permute,
    permute_reference,
    permute_rows,
    stable_expert_order,
    unpermute,
    unpermute_reference,
)


def _offsets(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _fast_and_reference(x_ND, w_EDF, offs_E):
    """Forward outputs and (dx, dw) of both paths for the same upstream gradient."""
    results = []
    for fn in (grouped_mm, grouped_mm_reference):
        x = x_ND.clone().requires_grad_()
        w = w_EDF.clone().requires_grad_()
        y = fn(x, w, offs_E)
        g = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).sin()
        (y * g).sum().backward()
        results.append((y.detach(), x.grad, w.grad))
    return results


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0], [1, 1, 1, 1], [0, 0, 0, 0], [7, 0, 0, 0]])
@pytest.mark.parametrize("D,F", [(8, 12), (4, 16)])
def test_grouped_mm_fast_matches_reference(counts, D, F):
    torch.manual_seed(0)
    x_ND = torch.randn(sum(counts), D)
    w_EDF = torch.randn(len(counts), D, F)
    assert supports_fast_path(x_ND, w_EDF)
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = _fast_and_reference(x_ND, w_EDF, _offsets(counts))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)


def test_grouped_mm_fast_path_backward_from_sum():
    # y.sum() hands the kernel a stride-0 gradient, which it rejects unless made dense.
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(2, 8, 4, requires_grad=True)
    grouped_mm(x, w, _offsets([2, 4])).sum().backward()
    torch.testing.assert_close(x.grad[:2], w.detach()[0].sum(1).expand(2, 8))


def test_grouped_mm_transposed_weight_uses_fast_path():
    w_EDF = torch.randn(3, 12, 8).transpose(1, 2)  # column-major per expert
    x_ND = torch.randn(9, 8)
    assert supports_fast_path(x_ND, w_EDF)
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = _fast_and_reference(x_ND, w_EDF, _offsets([4, 0, 5]))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)


@pytest.mark.parametrize(
    "x_shape,w_shape,dtype",
    [((5, 6), (2, 6, 8), torch.float32), ((5, 8), (2, 8, 5), torch.float32), ((5, 8), (2, 8, 8), torch.float64)],
)
def test_grouped_mm_unsupported_inputs_fall_back(x_shape, w_shape, dtype):
    x_ND = torch.randn(x_shape, dtype=dtype)
    w_EDF = torch.randn(w_shape, dtype=dtype)
    assert not supports_fast_path(x_ND, w_EDF)
    offs_E = _offsets([2, 3])
    torch.testing.assert_close(grouped_mm(x_ND, w_EDF, offs_E), grouped_mm_reference(x_ND, w_EDF, offs_E))


def test_grouped_mm_reference_is_per_expert_matmul():
    x_ND = torch.randn(5, 3, dtype=torch.float64)
    w_EDF = torch.randn(3, 3, 2, dtype=torch.float64)
    y_NF = grouped_mm_reference(x_ND, w_EDF, _offsets([2, 0, 3]))
    torch.testing.assert_close(y_NF[:2], x_ND[:2] @ w_EDF[0])
    torch.testing.assert_close(y_NF[2:], x_ND[2:] @ w_EDF[2])


def _per_block_autograd(x_ND, w_EDF, counts):
    """What the reference was before it became a custom op: a loop of matmuls under autograd."""
    ends = _offsets(counts).tolist()
    return torch.cat([x_ND[start:end] @ w_EDF[e] for e, (start, end) in enumerate(zip([0] + ends[:-1], ends))])


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0], [4, 1, 0, 0]])
def test_the_reference_and_its_gradients_are_those_of_the_per_block_matmuls_bit_for_bit(counts):
    torch.manual_seed(0)
    x_ND, w_EDF = torch.randn(sum(counts), 6), torch.randn(len(counts), 6, 5)
    results = []
    for fn in (lambda x, w: grouped_mm_reference(x, w, _offsets(counts)), lambda x, w: _per_block_autograd(x, w, counts)):
        x, w = x_ND.clone().requires_grad_(), w_EDF.clone().requires_grad_()
        y = fn(x, w)
        y.backward(torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).cos())
        results.append((y.detach(), x.grad, w.grad))
    for got, expected in zip(*results):
        assert torch.equal(got, expected)


def test_compiled_the_reference_is_traced_once_for_any_row_counts():
    """The counts are read on the host inside the custom op, so a new split of the same rows
    neither recompiles nor breaks the graph, forward or backward (AOT autograd)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(grouped_mm_reference, backend=counter, fullgraph=True)
    w_EDF = torch.randn(3, 4, 2, requires_grad=True)
    for counts in ([2, 3, 1], [0, 6, 0], [6, 0, 0]):
        x_ND = torch.randn(6, 4, requires_grad=True)
        y = compiled(x_ND, w_EDF, _offsets(counts))
        y.sum().backward()
        torch.testing.assert_close(y, _per_block_autograd(x_ND, w_EDF, counts), rtol=0, atol=0)
    assert counter.frame_count == 1


def _check_permute_matches_reference(x_TD, expert_idx_TK, num_experts):
    x_sorted, order, counts = permute(x_TD, expert_idx_TK, num_experts)
    x_sorted_ref, order_ref, counts_ref = permute_reference(x_TD, expert_idx_TK, num_experts)
    torch.testing.assert_close(x_sorted, x_sorted_ref)
    assert order.tolist() == order_ref.tolist()
    assert counts.tolist() == counts_ref.tolist()
    gates_TK = torch.rand(expert_idx_TK.shape)
    y_sorted = torch.randn_like(x_sorted)
    torch.testing.assert_close(unpermute(y_sorted, order, gates_TK), unpermute_reference(y_sorted, order, gates_TK))


_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device here: the GPU path is not exercised")),
]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("num_ids", [1, 8, 256, 257, 30_000, 70_000])
def test_stable_expert_order_is_the_int64_stable_argsort(num_ids, device):
    """Narrowed to uint8, int16 or int32 (or kept in int64) by the largest id, with many ties."""
    g = torch.Generator().manual_seed(num_ids)
    ids = torch.randint(0, num_ids, (5000,), generator=g)
    ids[:2], ids[2:4] = num_ids - 1, 0  # both ends of the range
    ids = ids.to(device)
    assert torch.equal(stable_expert_order(ids, num_ids), torch.argsort(ids, stable=True))


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize(
    "N,E", [(0, 4), (1, 1), (6, 4), (4095, 3), (4096, 8), (16_384, 8), (32_768, 128), (40_001, 64), (9000, 256)]
)
def test_expert_plan_is_the_stable_order_and_the_counts(N, E, device):
    """The one-launch plan on CUDA (one block of ids, several, a partial last one; experts left
    empty; and past its size limit, the plain ops) gives the stable argsort and the counts, the
    plain path's values, bit for bit."""
    g = torch.Generator().manual_seed(N + E)
    ids = torch.randint(0, max(1, E - 1), (N,), generator=g)  # the last expert gets none...
    ids[: min(N, 2)] = E - 1  # ...but for these two
    ids = ids.to(device)
    order, counts = expert_plan(ids, E)
    assert order.dtype == counts.dtype == torch.long
    assert torch.equal(order, torch.argsort(ids, stable=True))
    assert torch.equal(counts, expert_counts(ids, E))


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("M", [0, 1, 37])
def test_permute_rows_equals_index_select_and_its_gradient(M, device):
    """The same rows and the same input gradient, bit for bit, as autograd's index_select (whose
    backward adds into zeros), in bf16 as the dispatcher uses it."""
    g = torch.Generator().manual_seed(M)
    order_M = torch.randperm(M, generator=g).to(device)
    inverse_M = inverse_permutation(order_M)
    assert torch.equal(order_M[inverse_M], torch.arange(M, device=device))
    x_MD = torch.randn(M, 6, generator=g).to(device, torch.bfloat16)
    grad_MD = torch.randn(M, 6, generator=g).to(device, torch.bfloat16)
    results = []
    for select in (lambda x: permute_rows(x, order_M, inverse_M), lambda x: x.index_select(0, order_M)):
        x = x_MD.clone().requires_grad_()
        y = select(x)
        y.backward(grad_MD)
        results.append((y.detach(), x.grad))
    (y, dx), (y_ref, dx_ref) = results
    assert torch.equal(y, y_ref)
    assert torch.equal(dx, dx_ref)


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 9), E=st.integers(1, 5), data=st.data())
def test_permute_unpermute_match_reference(T, E, data):
    K = data.draw(st.integers(1, E))
    # top-k ids are distinct per token: a random permutation prefix per row
    rows = [data.draw(st.permutations(range(E)))[:K] for _ in range(T)]
    expert_idx_TK = torch.tensor(rows, dtype=torch.long).reshape(T, K)
    _check_permute_matches_reference(torch.randn(T, 3), expert_idx_TK, E)


def test_permute_is_expert_major_and_stable():
    expert_idx_TK = torch.tensor([[2, 0], [0, 1], [2, 1]])
    x_TD = torch.arange(3.0).unsqueeze(1)
    x_sorted, order, counts = permute(x_TD, expert_idx_TK, num_experts=4)
    assert order.tolist() == [1, 2, 3, 5, 0, 4]  # flat t*K+k; expert 0, 1, 2, 3(empty)
    assert counts.tolist() == [2, 2, 2, 0]
    assert x_sorted.squeeze(1).tolist() == [0.0, 1.0, 1.0, 2.0, 0.0, 2.0]


@pytest.mark.parametrize("E", [1, 3])
def test_unpermute_inverts_permute_with_unit_gates(E):
    T = 7
    x_TD = torch.randn(T, 5)
    expert_idx_TK = torch.randint(E, (T, 1))
    x_sorted, order, _ = permute(x_TD, expert_idx_TK, E)
    torch.testing.assert_close(unpermute(x_sorted, order, torch.ones(T, 1)), x_TD)


def test_all_tokens_to_one_expert_and_empty_experts():
    T, E = 6, 4
    expert_idx_TK = torch.full((T, 1), 2)
    x_TD = torch.randn(T, 3)
    x_sorted, order, counts = permute(x_TD, expert_idx_TK, E)
    assert counts.tolist() == [0, 0, T, 0]
    assert order.tolist() == list(range(T))
    torch.testing.assert_close(x_sorted, x_TD)
    _check_permute_matches_reference(x_TD, expert_idx_TK, E)


def test_k_equals_num_experts_sums_all_gated_copies():
    T, E = 5, 3
    expert_idx_TK = torch.stack([torch.randperm(E) for _ in range(T)])
    x_TD = torch.randn(T, 4)
    x_sorted, order, counts = permute(x_TD, expert_idx_TK, E)
    assert counts.tolist() == [T] * E
    gates_TK = torch.rand(T, E)
    y_TD = unpermute(x_sorted, order, gates_TK)
    torch.testing.assert_close(y_TD, gates_TK.sum(1, keepdim=True) * x_TD)
    _check_permute_matches_reference(x_TD, expert_idx_TK, E)


def test_permute_gradients_flow_back_to_tokens():
    T, K, E = 4, 2, 3
    x_TD = torch.randn(T, 3, requires_grad=True)
    expert_idx_TK = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    gates_TK = torch.rand(T, K, requires_grad=True)
    x_sorted, order, _ = permute(x_TD, expert_idx_TK, E)
    y_TD = unpermute(2.0 * x_sorted, order, gates_TK)
    y_TD.sum().backward()
    torch.testing.assert_close(x_TD.grad, 2.0 * gates_TK.detach().sum(1, keepdim=True).expand(T, 3))
    torch.testing.assert_close(gates_TK.grad, 2.0 * x_TD.detach().sum(1, keepdim=True).expand(T, K))


def test_grouped_mm_under_autocast_computes_in_autocast_dtype():
    x_ND = torch.randn(10, 16)
    w_EDF = torch.randn(3, 16, 8)
    offs_E = _offsets([4, 0, 6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_NF = grouped_mm(x_ND, w_EDF, offs_E)
        y_ref = grouped_mm_reference(x_ND, w_EDF, offs_E)  # plain matmuls autocast by themselves
    assert y_NF.dtype == y_ref.dtype == torch.bfloat16
    assert supports_fast_path(x_ND.bfloat16(), w_EDF.bfloat16())
    torch.testing.assert_close(y_NF, y_ref)


def test_permute_under_autocast_moves_copies_in_the_matmul_dtype():
    """Under autocast a float32 x is gathered as the bf16 copies the experts' matmuls take, and
    its gradient is the float32 sum of the copies' bf16 gradients, as a cast after the gather
    gives it."""
    torch.manual_seed(5)
    T, K, E, D = 11, 3, 4, 8
    expert_idx_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    x_TD = torch.randn(T, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x_sorted, order, _ = permute(x_TD, expert_idx_TK, E)
    assert x_sorted.dtype == torch.bfloat16
    rows_ND = torch.randn(T * K, D).bfloat16()
    (x_sorted.float() * rows_ND.float()).sum().backward()
    assert x_TD.grad.dtype == torch.float32
    reference_sorted, _, _ = permute_reference(x_TD.detach(), expert_idx_TK, E)
    assert torch.equal(x_sorted, reference_sorted.bfloat16())
    expected = torch.zeros(T, D, dtype=torch.float64)
    expected.index_add_(0, order // K, rows_ND.double())
    torch.testing.assert_close(x_TD.grad, expected.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("T,K,E", [(9, 2, 4), (16, 3, 5), (1, 1, 1)])
def test_permute_unpermute_gradients_match_reference(T, K, E):
    """The fast backward (gathers, float32 sums) against autograd through the reference loops."""
    torch.manual_seed(T * 100 + K)
    expert_idx_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    x_TD = torch.randn(T, 6, dtype=torch.float64)
    gates_TK = torch.rand(T, K, dtype=torch.float64)
    grad_TD = torch.randn(T, 6, dtype=torch.float64)
    grads = []
    for perm, unperm in ((permute, unpermute), (permute_reference, unpermute_reference)):
        x, gates = x_TD.clone().requires_grad_(True), gates_TK.clone().requires_grad_(True)
        x_sorted, order, _ = perm(x, expert_idx_TK, E)
        y = unperm(torch.tanh(x_sorted), order, gates)
        y.backward(grad_TD)
        grads.append((y.detach(), x.grad, gates.grad))
    for fast, reference in zip(*grads):
        torch.testing.assert_close(fast, reference)


def test_traced_combine_matches_the_eager_one_in_bf16():
    """Traced (is_compiling), the combine and its gate gradient are float32 products and sums
    instead of batched matmuls: the same values to bf16 rounding."""
    torch.manual_seed(3)
    T, K, E, D = 33, 4, 6, 40
    expert_idx_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    y_TD = torch.randn(T * K, D).bfloat16()
    gates_TK = torch.rand(T, K)
    grad_TD = torch.randn(T, D).bfloat16()
    _, order_N, _ = permute(torch.zeros(T, 1), expert_idx_TK, E)
    results = []
    for combine in (unpermute, torch.compile(unpermute, backend="aot_eager", fullgraph=True)):
        y_sorted, gates = y_TD.clone().requires_grad_(True), gates_TK.clone().requires_grad_(True)
        out = combine(y_sorted, order_N, gates)
        out.backward(grad_TD)
        results.append((out.detach().float(), y_sorted.grad.float(), gates.grad))
    for traced, eager in zip(results[1], results[0]):
        torch.testing.assert_close(traced, eager, rtol=1.6e-2, atol=1e-2)
