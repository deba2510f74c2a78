"""The Triton kernels of `dyad/kernels/moe_router.py` (its docstring says what each computes), in a
module of their own so that they can share jitted helpers; imported only where Triton is. MATH
("native", "bf16_pieces" or "tf32x3") is how a kernel multiplies: `dyad/kernels/moe_router.py`.

A long sum runs in chunks: each chunk's tensor-core products start from a fresh accumulator and
the chunks are added as float32 adds. Accumulating a whole row of D (or a split's rows) inside
the tensor cores' accumulator instead was far less accurate on the benchmark's shapes (their
adds are not rounded as float32 adds are; tests/unit/test_moe_router.py holds the bounds). The
fresh accumulator is `zero`, a run-time argument: from a constant zero, Triton would fold the
chunk's add back into the tensor-core accumulation."""

import triton
import triton.language as tl


@triton.jit
def bf16_pieces(a):
    """float32 `a` as three bf16 pieces, largest first, whose float32 sum is `a`: each piece
    is the rest rounded to bf16, and every rest is exact in float32."""
    hi = a.to(tl.bfloat16)
    rest = a - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def dot_pieces(hi, mid, lo, b, acc):
    """acc + (hi + mid + lo) @ b, smallest piece first."""
    acc = tl.dot(lo, b, acc)
    acc = tl.dot(mid, b, acc)
    return tl.dot(hi, b, acc)


@triton.jit
def logits_block(x_ptr, w_ptr, t, T, D, E, zero, E_P: tl.constexpr, MATH: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """The float32 logits of the BLOCK_T rows `t` against every expert, [BLOCK_T, E_P]; 0 past T and E."""
    e = tl.arange(0, E_P)
    acc = tl.zeros((BLOCK_T, E_P), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=(t[:, None] < T) & (d[None, :] < D), other=0.0)
        w = tl.load(w_ptr + e[None, :] * D + d[:, None], mask=(e[None, :] < E) & (d[:, None] < D), other=0.0)
        part = tl.zeros((BLOCK_T, E_P), dtype=tl.float32) + zero
        if MATH == "native":
            part = tl.dot(x, w, part)
        elif MATH == "bf16_pieces":  # w float32: its pieces on the right
            w_hi, w_mid, w_lo = bf16_pieces(w)
            part = tl.dot(x, w_lo, part)
            part = tl.dot(x, w_mid, part)
            part = tl.dot(x, w_hi, part)
        else:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), part, input_precision="tf32x3")
        acc += part
    return acc


@triton.jit
def logits(x_ptr, w_ptr, out_ptr, T, D, E, zero, E_P: tl.constexpr, MATH: tl.constexpr, BLOCK_T: tl.constexpr,
           BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_P)
    acc = logits_block(x_ptr, w_ptr, t, T, D, E, zero, E_P, MATH, BLOCK_T, BLOCK_D)
    tl.store(out_ptr + t[:, None] * E + e[None, :], acc, mask=(t[:, None] < T) & (e[None, :] < E))


@triton.jit
def input_grad(g_ptr, w_ptr, out_ptr, T, D, E, E_P: tl.constexpr, MATH: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """One block of rows of g, read (and split) once, against every block of w's columns."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_P)
    g = tl.load(g_ptr + t[:, None] * E + e[None, :], mask=(t[:, None] < T) & (e[None, :] < E), other=0.0)
    g_hi, g_mid, g_lo = bf16_pieces(g)
    for start in range(0, D, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        w = tl.load(w_ptr + e[:, None] * D + d[None, :], mask=(e[:, None] < E) & (d[None, :] < D), other=0.0)
        if MATH == "bf16_pieces":
            grad = dot_pieces(g_hi, g_mid, g_lo, w, tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32))
        else:
            grad = tl.dot(g, w.to(tl.float32), input_precision="tf32x3")
        tl.store(out_ptr + t[:, None] * D + d[None, :], grad.to(out_ptr.dtype.element_ty),
                 mask=(t[:, None] < T) & (d[None, :] < D))


@triton.jit
def weight_grad(g_ptr, x_ptr, out_ptr, T, D, E, rows_per_split, zero, E_P: tl.constexpr, MATH: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    split = tl.program_id(1)
    e = tl.arange(0, E_P)
    acc = tl.zeros((E_P, BLOCK_D), dtype=tl.float32)
    first = split * rows_per_split
    for start in range(first, tl.minimum(first + rows_per_split, T), BLOCK_T):
        t = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
        inside = (t < T) & (t < first + rows_per_split)
        g = tl.load(g_ptr + t[None, :] * E + e[:, None], mask=inside[None, :] & (e[:, None] < E), other=0.0)
        x = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=inside[:, None] & (d[None, :] < D), other=0.0)
        part = tl.zeros((E_P, BLOCK_D), dtype=tl.float32) + zero
        if MATH == "bf16_pieces":
            g_hi, g_mid, g_lo = bf16_pieces(g)
            part = dot_pieces(g_hi, g_mid, g_lo, x, part)
        else:
            part = tl.dot(g, x.to(tl.float32), part, input_precision="tf32x3")
        acc += part
    tl.store(out_ptr + (split * E + e[:, None]).to(tl.int64) * D + d[None, :], acc,
             mask=(e[:, None] < E) & (d[None, :] < D))


@triton.jit
def store_softmax_topk(logits, t, bias_ptr, scores_ptr, gates_ptr, idx_ptr, T, E, K: tl.constexpr, K_P: tl.constexpr,
                       E_P: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Softmax over the experts of the logits of the BLOCK_T rows `t` ([BLOCK_T, E_P], finite),
    then the top k (scores + bias), largest first, ties to the lower expert; stores scores, gates
    and ids."""
    e = tl.arange(0, E_P)
    j = tl.arange(0, K_P)
    inside = (t[:, None] < T) & (e[None, :] < E)
    logits = tl.where(e[None, :] < E, logits, -float("inf"))  # rows past T stay finite
    shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    scores = shifted / tl.sum(shifted, axis=1)[:, None]
    tl.store(scores_ptr + t[:, None] * E + e[None, :], scores, mask=inside)
    key = scores
    if HAS_BIAS:
        key = scores + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :]
    key = tl.where(e[None, :] < E, key, -float("inf"))
    gates = tl.zeros((BLOCK_T, K_P), dtype=tl.float32)
    idx = tl.zeros((BLOCK_T, K_P), dtype=tl.int64)
    for rank in tl.static_range(K):
        best = tl.argmax(key, axis=1, tie_break_left=True)
        chosen = e[None, :] == best[:, None]
        gate = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
        gates = tl.where(j[None, :] == rank, gate[:, None], gates)
        idx = tl.where(j[None, :] == rank, best[:, None].to(tl.int64), idx)
        key = tl.where(chosen, -float("inf"), key)
    if NORMALIZE:
        gates = gates / (tl.sum(gates, axis=1)[:, None] + 1e-20)
    at = t[:, None] * K + j[None, :]
    stored = (t[:, None] < T) & (j[None, :] < K)
    tl.store(gates_ptr + at, gates, mask=stored)
    tl.store(idx_ptr + at, idx, mask=stored)


@triton.jit
def softmax_topk(logits_ptr, bias_ptr, scores_ptr, gates_ptr, idx_ptr, T, E, K: tl.constexpr, K_P: tl.constexpr,
                 E_P: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_P)
    logits = tl.load(logits_ptr + t[:, None] * E + e[None, :], mask=(t[:, None] < T) & (e[None, :] < E), other=0.0)
    store_softmax_topk(logits, t, bias_ptr, scores_ptr, gates_ptr, idx_ptr, T, E, K, K_P, E_P, HAS_BIAS, NORMALIZE,
                       BLOCK_T)


@triton.jit
def logits_softmax_topk(x_ptr, w_ptr, bias_ptr, scores_ptr, gates_ptr, idx_ptr, T, D, E, zero, K: tl.constexpr,
                        K_P: tl.constexpr, E_P: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                        MATH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """`logits` and then `softmax_topk` on its block in registers: one launch, the logits unwritten."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    logits = logits_block(x_ptr, w_ptr, t, T, D, E, zero, E_P, MATH, BLOCK_T, BLOCK_D)
    store_softmax_topk(logits, t, bias_ptr, scores_ptr, gates_ptr, idx_ptr, T, E, K, K_P, E_P, HAS_BIAS, NORMALIZE,
                       BLOCK_T)
