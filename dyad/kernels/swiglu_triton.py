"""The Triton kernels of `dyad/kernels/swiglu.py` (its docstring says what they compute), in a module
of their own so that both pairs of kernels share the gate's jitted math and so agree bitwise;
imported only where Triton is.

`gate_forward` / `gate_backward` read h1 and h3 as two tensors; `pairs_forward` /
`pairs_backward` read them as the (gate, up) column pairs of one interleaved tensor, each program
loading BLOCK pairs as one contiguous run of 2 * BLOCK elements and splitting it in registers."""

import triton
import triton.language as tl


@triton.jit
def gate(h1, h3):
    x = h1.to(tl.float32)
    silu = (x / (1.0 + tl.exp(-x))).to(h1.dtype)  # rounded, as eager's silu output is
    return (silu.to(tl.float32) * h3.to(tl.float32)).to(h1.dtype)


@triton.jit
def gate_grads(grad, h1, h3):
    """(grad_h1, grad_h3) in the operands' dtype, from the output's gradient in float32."""
    x = h1.to(tl.float32)
    one_plus_exp = 1.0 + tl.exp(-x)
    sigmoid = 1.0 / one_plus_exp
    silu = (x / one_plus_exp).to(h1.dtype).to(tl.float32)  # as the forward rounds it
    grad_h3 = grad * silu
    grad_silu = (grad * h3.to(tl.float32)).to(h1.dtype).to(tl.float32)
    grad_h1 = grad_silu * sigmoid * (1.0 + x * (1.0 - sigmoid))  # silu's derivative, as eager's
    return grad_h1.to(h1.dtype), grad_h3.to(h1.dtype)


@triton.jit
def gate_forward(h1_ptr, h3_ptr, out_ptr, n, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    h1 = tl.load(h1_ptr + at, mask=inside, other=0.0)
    h3 = tl.load(h3_ptr + at, mask=inside, other=0.0)
    tl.store(out_ptr + at, gate(h1, h3), mask=inside)


@triton.jit
def gate_backward(grad_ptr, h1_ptr, h3_ptr, grad_h1_ptr, grad_h3_ptr, n, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    grad = tl.load(grad_ptr + at, mask=inside, other=0.0).to(tl.float32)
    h1 = tl.load(h1_ptr + at, mask=inside, other=0.0)
    h3 = tl.load(h3_ptr + at, mask=inside, other=0.0)
    grad_h1, grad_h3 = gate_grads(grad, h1, h3)
    tl.store(grad_h1_ptr + at, grad_h1, mask=inside)
    tl.store(grad_h3_ptr + at, grad_h3, mask=inside)


@triton.jit
def load_pairs(h13_ptr, pair0, n, BLOCK: tl.constexpr):
    """(gates, ups) of pairs pair0 .. pair0 + BLOCK - 1 (of n) from one contiguous load."""
    at = pair0 * 2 + tl.arange(0, 2 * BLOCK)
    h13 = tl.load(h13_ptr + at, mask=at < 2 * n, other=0.0)
    return tl.split(tl.reshape(h13, (BLOCK, 2)))


@triton.jit
def pairs_forward(h13_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pair0 = tl.program_id(0).to(tl.int64) * BLOCK
    h1, h3 = load_pairs(h13_ptr, pair0, n, BLOCK)
    at = pair0 + tl.arange(0, BLOCK)
    tl.store(out_ptr + at, gate(h1, h3), mask=at < n)


@triton.jit
def pairs_backward(grad_ptr, h13_ptr, grad_h13_ptr, n, BLOCK: tl.constexpr):
    pair0 = tl.program_id(0).to(tl.int64) * BLOCK
    h1, h3 = load_pairs(h13_ptr, pair0, n, BLOCK)
    at = pair0 + tl.arange(0, BLOCK)
    grad = tl.load(grad_ptr + at, mask=at < n, other=0.0).to(tl.float32)
    grad_h1, grad_h3 = gate_grads(grad, h1, h3)
    at2 = pair0 * 2 + tl.arange(0, 2 * BLOCK)
    grad_h13 = tl.reshape(tl.join(grad_h1, grad_h3), (2 * BLOCK,))
    tl.store(grad_h13_ptr + at2, grad_h13, mask=at2 < 2 * n)
