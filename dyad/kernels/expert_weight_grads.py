"""Expert GEMMs whose weight gradients are added into `.grad` by the GEMM itself.

Legend: N rows (expert-major), D input dim, F output dim, E experts.

Autograd computes a weight gradient into a new tensor, then adds it into `.grad` (and, under
autocast, first casts it to the float32 master weight's dtype): for the Mixtral-like layer's
three 8 x 4096 x 14,336 weights that add alone reads and writes 8.5 GB.
`expert_grouped_mm` computes the same forward and input gradient as `grouped_mm`, but adds
each expert's weight gradient, x_e^T @ grad_e, into `w.grad[e]` with one cuBLAS GEMM (beta = 1,
float32 accumulation, written in the gradient's dtype), as Megatron-LM's gradient accumulation
fusion does; autograd sees no gradient for the weight. Row counts reach the host through a
pinned copy made in the forward, read in the backward (the host waits there only when it has
run more than that forward ahead of the GPU). The experts' GEMMs run on two side streams that
the current stream waits for when the backward pass ends (see `add_weight_grads`): `.grad` is
complete when `backward()` has returned, as autograd's is.

A bf16 working weight's (`dyad/working_weights.py`) gradient is added into its float32 master.
It applies to CUDA leaf weights with few experts (one GEMM launch per expert: with many small
experts the launches would cost more than the add) outside torch.compile; everywhere else
`expert_grouped_mm` is `grouped_mm`. Nothing that reads weight gradients from autograd itself
(hooks on the parameter, `torch.autograd.grad`) sees these: dyad reads `.grad` after backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dyad.kernels.grouped_mm import _autocast, _standard_strides, grouped_mm, supports_fast_path
from dyad.kernels.master_weights import master_of

MAX_EXPERTS = 16  # beyond this the per-expert launches cost more than the add they save


def expert_grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """`grouped_mm`, with w's gradient added into `w.grad` by the GEMM where that applies."""
    x_c, w_c = _autocast(x_ND), _autocast(w_EDF)
    grad_into = _gradient_owner(w_EDF)
    if not _into_grad_applies(x_c, grad_into, w_c):
        return grouped_mm(x_ND, w_EDF, offs_E)
    return _GroupedMmIntoGrad.apply(x_c, grad_into, w_c.detach(), offs_E.to(torch.int32))


def _gradient_owner(w_EDF: torch.Tensor) -> torch.Tensor:
    """The tensor whose `.grad` gets w's gradient: a bf16 working weight's float32 master, else w."""
    master = None if torch.compiler.is_compiling() else master_of(w_EDF)
    return w_EDF if master is None else master


def _into_grad_applies(x_ND, w_EDF, w_c) -> bool:
    return (
        w_EDF.is_cuda
        and w_EDF.is_leaf
        and w_EDF.requires_grad
        and torch.is_grad_enabled()
        and w_EDF.shape[0] <= MAX_EXPERTS
        and not torch.compiler.is_compiling()
        and supports_fast_path(x_ND, w_c)
    )


class RowEndsOnHost:
    """The experts' row ends (offs), copied to pinned host memory when made (in a forward) and
    read when needed (in its backward): the host waits only if it has run more than that
    forward ahead of the GPU."""

    def __init__(self, offs_E: torch.Tensor):
        self._host = torch.empty(offs_E.shape, dtype=offs_E.dtype, pin_memory=True)
        self._host.copy_(offs_E, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def get(self) -> list[int]:
        self._ready.synchronize()
        return self._host.tolist()


class _GroupedMmIntoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w_EDF, w_compute_EDF, offs_E):
        ctx.weight = w_EDF
        ctx.row_ends = RowEndsOnHost(offs_E)
        ctx.save_for_backward(x_ND, w_compute_EDF, offs_E)
        return F.grouped_mm(x_ND, w_compute_EDF, offs=offs_E)

    @staticmethod
    def backward(ctx, grad_NF):
        x_ND, w_EDF, offs_E = ctx.saved_tensors
        grad_NF = _standard_strides(grad_NF)
        sides = _side_streams_after_current(x_ND.device)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = F.grouped_mm(grad_NF, w_EDF.transpose(-2, -1), offs=offs_E)
        add_weight_grads(ctx.weight, x_ND, grad_NF, ctx.row_ends.get(), sides)
        return grad_x, None, None, None


def add_weight_grads(
    weight: torch.Tensor, x_ND: torch.Tensor, grad_NF: torch.Tensor, ends: list[int], sides: list[torch.cuda.Stream]
) -> None:
    """weight.grad[e] += x[rows of e]^T @ grad[rows of e] (created at the first call), queued on
    `sides`, two streams that have waited for the current one, which waits for them in turn only
    when the backward pass ends (`join_when_backward_ends`).

    The experts alternate between the two (even experts on one, odd on the other), so that the
    next expert's GEMM fills what the tail of the last one leaves idle (its last, partial wave
    of tiles), and they overlap the work the current stream goes on with: the input-gradient
    GEMMs' tails and the memory-bound kernels between them (SwiGLU's backward, the router's).
    Each stream is entered once and gets its experts in order (entering a stream costs the host
    more than launching a GEMM). Each expert's slice is written by one GEMM on one stream,
    always the same one, so the result is that of one stream."""
    fresh = weight.grad is None
    if fresh:
        weight.grad = torch.empty_like(weight)
    for t in (x_ND, grad_NF, weight.grad):
        for side in sides:
            t.record_stream(side)  # their memory is not reused before the side streams are done
    starts = [0] + ends[:-1]
    for parity, side in enumerate(sides):
        with torch.cuda.stream(side):
            for e in range(parity, len(ends), len(sides)):
                rows = slice(starts[e], ends[e])
                _add_expert_grad(weight.grad[e], x_ND[rows].t(), grad_NF[rows], fresh)
    main = torch.cuda.current_stream()

    def join() -> None:
        for side in sides:
            main.wait_stream(side)

    join_when_backward_ends(join)


def join_when_backward_ends(join) -> None:
    """Calls `join` when the autograd engine has run the whole backward pass this is called from
    (before `backward()` returns), or at once outside one."""
    if torch._C._current_graph_task_id() == -1:
        join()
    else:
        torch.autograd.Variable._execution_engine.queue_callback(join)


def _add_expert_grad(out: torch.Tensor, rows_x: torch.Tensor, rows_grad: torch.Tensor, fresh: bool) -> None:
    if rows_grad.shape[0] == 0:
        if fresh:
            out.zero_()
    elif out.dtype == rows_x.dtype:
        torch.mm(rows_x, rows_grad, out=out) if fresh else out.addmm_(rows_x, rows_grad)
    elif fresh:  # e.g. bf16 operands of a float32 master weight under autocast
        torch.mm(rows_x, rows_grad, out_dtype=out.dtype, out=out)
    else:
        torch.addmm(out, rows_x, rows_grad, out_dtype=out.dtype, out=out)


def _side_streams_after_current(device: torch.device) -> list[torch.cuda.Stream]:
    """The device's two side streams, each made to wait for what the current stream has queued."""
    sides = _side_streams(device)
    for side in sides:
        side.wait_stream(torch.cuda.current_stream(device))
    return sides


@functools.cache
def _side_streams(device: torch.device) -> list[torch.cuda.Stream]:
    return [torch.cuda.Stream(device=device) for _ in range(2)]
