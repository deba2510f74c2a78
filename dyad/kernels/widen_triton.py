"""The Triton kernel of `dyad/kernels/widen.py` (its docstring says what it computes), in a module
of its own; imported only where Triton is. One program per block of elements: out = src widened
to float32, plus acc's element where ADD."""

import triton
import triton.language as tl


@triton.jit
def widen(src_ptr, out_ptr, acc_ptr, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    value = tl.load(src_ptr + at, mask=inside).to(tl.float32)
    if ADD:
        value = tl.load(acc_ptr + at, mask=inside) + value
    tl.store(out_ptr + at, value, mask=inside)
