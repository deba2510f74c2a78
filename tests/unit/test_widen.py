"""The working weights' gradient hand-over (dyad/kernels/widen.py): widening a bf16 gradient and
adding it into a float32 one give PyTorch's float32 results bit for bit, in any dense layout."""

import pytest
import torch

from dyad.kernels import widen

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the Triton widening kernels are not exercised"
)


def _pair(shape, device, transposed=False):
    torch.manual_seed(sum(shape))
    src = torch.randn(shape, device=device).bfloat16()
    if transposed:
        src = src.transpose(-2, -1).contiguous().transpose(-2, -1)  # dense, not contiguous
    return src, torch.randn(shape, device=device)


def test_off_cuda_the_references_run():
    src, acc = _pair((3, 5), "cpu")
    assert not widen._fused_applies(src)
    assert torch.equal(widen.widened(src), src.float())
    expected = acc + src.float()
    assert torch.equal(widen.add_widened_(acc, src), expected)


def test_dense_layouts_are_told_from_gapped_ones():
    t = torch.zeros(4, 6, 8)
    assert widen._dense(t) and widen._dense(t.transpose(1, 2)) and widen._dense(t.permute(2, 0, 1))
    assert not widen._dense(t[:, :3]) and not widen._dense(t[..., ::2])


@needs_cuda
@pytest.mark.parametrize("shape", [(7,), (4099, 3), (3, 256, 96)])
@pytest.mark.parametrize("transposed", [False, True])
def test_cuda_kernels_equal_pytorch_bit_for_bit(shape, transposed):
    if transposed and len(shape) < 2:
        pytest.skip("one dim: no transpose")
    src, acc = _pair(shape, "cuda", transposed)
    assert widen._fused_applies(src)
    got = widen.widened(src)
    assert got.stride() == src.to(torch.float32).stride() and torch.equal(got, src.float())
    acc = widen.widened(src) * 3  # an accumulated gradient has its gradient's layout
    assert acc.stride() == src.stride()
    expected = acc.clone().add_(src)
    assert torch.equal(widen.add_widened_(acc, src), expected)
