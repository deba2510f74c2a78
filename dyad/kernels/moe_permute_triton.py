"""The Triton kernel of `dyad/kernels/moe_permute.py`'s `expert_plan` (its docstring says what it
computes), in a module of its own; imported only where Triton is.

One program per expert e reads every assignment's expert id twice: first counting the ids below e
(where e's rows start) and equal to e, then writing the flat index of each assignment of e to its
row, block after block in flat order and, within a block, by a running count of e's ids (a scan),
so the order within an expert is the flat order, as a stable sort's."""

import triton
import triton.language as tl


@triton.jit
def expert_plan(ids_ptr, order_ptr, counts_ptr, N, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    below = tl.zeros((BLOCK,), dtype=tl.int32)
    mine = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, N, BLOCK):
        at = start + tl.arange(0, BLOCK)
        inside = at < N
        ids = tl.load(ids_ptr + at, mask=inside, other=0)
        below += (inside & (ids < e)).to(tl.int32)
        mine += (inside & (ids == e)).to(tl.int32)
    row = tl.sum(below, axis=0).to(tl.int64)
    tl.store(counts_ptr + e, tl.sum(mine, axis=0).to(tl.int64))
    for start in range(0, N, BLOCK):
        at = start + tl.arange(0, BLOCK)
        inside = at < N
        ids = tl.load(ids_ptr + at, mask=inside, other=0)
        is_e = (inside & (ids == e)).to(tl.int32)
        rank = tl.cumsum(is_e, axis=0) - 1
        tl.store(order_ptr + row + rank, at.to(tl.int64), mask=is_e != 0)
        row += tl.sum(is_e, axis=0).to(tl.int64)
