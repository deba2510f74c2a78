"""An expert weight scaled and cast to e4m3 in both layouts its GEMMs read, in one pass.

Legend: E experts, D input dim, F output dim; w_EDF is one expert weight (x @ w[e] forward).
The forward GEMM reads codes of w[e].T ([E, F, D], one scale per output column f, taken over D);
the input-gradient GEMM reads codes of w[e] ([E, D, F], one scale per row d, taken over F).
Quantizing each layout on its own reads the weight twice and writes a transposed copy; here
one Triton program per [BLOCK_D, BLOCK_F] tile reads it once and writes both.

`scale_into_both_layouts` takes the scales (powers of two, computed by dyad/kernels/fp8.py) and is
exact but for e4m3's rounding of each product; `scale_into_both_layouts_reference` is the same
in plain PyTorch, and what runs off CUDA or without Triton.
"""

from __future__ import annotations

import functools

import torch

from dyad.kernels.launch_sizes import cdiv

E4M3 = torch.float8_e4m3fn


def scale_into_both_layouts_reference(w_EDF, scale_over_F_ED1, scale_over_D_E1F):
    """(codes of w * scale_over_F as [E, D, F], codes of w * scale_over_D as [E, F, D])."""
    w = w_EDF.detach()
    codes_EDF = (w * scale_over_F_ED1.to(w.dtype)).to(E4M3)
    codes_EFD = (w * scale_over_D_E1F.to(w.dtype)).to(E4M3).transpose(1, 2).contiguous()
    return codes_EDF, codes_EFD


def scale_into_both_layouts(w_EDF, scale_over_F_ED1, scale_over_D_E1F):
    kernel = _kernel() if w_EDF.is_cuda else None
    if kernel is None:
        return scale_into_both_layouts_reference(w_EDF, scale_over_F_ED1, scale_over_D_E1F)
    w = w_EDF.detach().contiguous()
    E, D, F = w.shape
    codes_EDF = torch.empty((E, D, F), dtype=E4M3, device=w.device)
    codes_EFD = torch.empty((E, F, D), dtype=E4M3, device=w.device)
    block_d = block_f = 64
    grid = (cdiv(D, block_d), cdiv(F, block_f), E)
    kernel[grid](
        w, scale_over_F_ED1.float().contiguous(), scale_over_D_E1F.float().contiguous(),
        codes_EDF, codes_EFD, D, F, BLOCK_D=block_d, BLOCK_F=block_f,
    )
    return codes_EDF, codes_EFD


@functools.cache
def _kernel():
    """The Triton kernel, or None where Triton is missing (CPU-only installs)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def both_layouts(w_ptr, row_scale_ptr, col_scale_ptr, rows_out_ptr, cols_out_ptr, D, F,
                     BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr):
        d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        e = tl.program_id(2).to(tl.int64)
        inside = (d[:, None] < D) & (f[None, :] < F)
        base = e * D * F
        w = tl.load(w_ptr + base + d[:, None] * F + f[None, :], mask=inside, other=0.0).to(tl.float32)
        row_scale = tl.load(row_scale_ptr + e * D + d, mask=d < D, other=1.0)
        col_scale = tl.load(col_scale_ptr + e * F + f, mask=f < F, other=1.0)
        # products with powers of two are exact in float32; the cast rounds to nearest even
        rows = (w * row_scale[:, None]).to(tl.float8e4nv)
        tl.store(rows_out_ptr + base + d[:, None] * F + f[None, :], rows, mask=inside)
        cols = tl.trans((w * col_scale[None, :]).to(tl.float8e4nv))  # [BLOCK_F, BLOCK_D]
        tl.store(cols_out_ptr + base + f[:, None] * D + d[None, :], cols, mask=tl.trans(inside))

    return both_layouts
