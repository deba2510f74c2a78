"""Grouped matmul for dropless MoE experts: row block e of x is multiplied by w[e].

Legend: N rows (token-expert assignments, expert-major), D input dim, F output dim, E experts.

`grouped_mm` uses `torch.nn.functional.grouped_mm` when a cheap predicate on dtype, device and
memory layout says the kernel accepts the inputs, otherwise `grouped_mm_reference`, a loop of
plain matmuls over the row blocks. Both are differentiable and compute the same function.
Under autocast, float32 operands are cast to the autocast dtype first, as a matmul's would be
(the fused kernel is not on autocast's list, so without this it would stay in float32).
"""

import torch
import torch.nn.functional as F

_FAST_KERNEL = getattr(F, "grouped_mm", None)
_ALIGN_BYTES = 16  # the kernel needs 16-byte-aligned base pointers and non-unit strides


def grouped_mm_reference(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x times w[e], one matmul per expert (offs[-1] == N)."""
    return _blocks_times_experts(x_ND, w_EDF, offs_E)


def _row_blocks(offs_E: torch.Tensor) -> list[slice]:
    ends = offs_E.tolist()
    return [slice(start, end) for start, end in zip([0] + ends[:-1], ends)]


# The reference reads the row counts on the host, so traced by torch.compile every new count would
# recompile: it is a custom op, which the compiler keeps whole in its graph and runs as it is (a
# torch.compiler.disable'd function would break the graph there, and importing this module would
# import torch._dynamo). Its gradients are the per-block matmuls autograd would make.
@torch.library.custom_op("dyad::grouped_mm_blocks", mutates_args=())
def _blocks_times_experts(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return torch.cat([x_ND[rows] @ w_EDF[e] for e, rows in enumerate(_row_blocks(offs_E))], dim=0)


@_blocks_times_experts.register_fake
def _(x_ND, w_EDF, offs_E):
    return x_ND.new_empty((x_ND.shape[0], w_EDF.shape[-1]))


@torch.library.custom_op("dyad::grouped_mm_blocks_weight_grad", mutates_args=())
def _weight_grads_of_blocks(x_ND: torch.Tensor, grad_NF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Stacked x[rows of e]^T @ grad[rows of e] over the experts: the weights' gradient."""
    return torch.stack([x_ND[rows].t() @ grad_NF[rows] for rows in _row_blocks(offs_E)])


@_weight_grads_of_blocks.register_fake
def _(x_ND, grad_NF, offs_E):
    return x_ND.new_empty((offs_E.shape[0], x_ND.shape[1], grad_NF.shape[1]))


def _keep_operands(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _blocks_backward(ctx, grad_NF):
    x_ND, w_EDF, offs_E = ctx.saved_tensors
    grad_x = _blocks_times_experts(grad_NF, w_EDF.transpose(-2, -1), offs_E) if ctx.needs_input_grad[0] else None
    grad_w = _weight_grads_of_blocks(x_ND, grad_NF, offs_E) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_blocks_times_experts.register_autograd(_blocks_backward, setup_context=_keep_operands)


def _base_aligned(t: torch.Tensor) -> bool:
    # Traced tensors have no address. The operands the MoE layer passes are parameters and fresh
    # outputs, which the allocator aligns; a misaligned view would make the kernel raise.
    return torch.compiler.is_compiling() or t.data_ptr() % _ALIGN_BYTES == 0


def _aligned(t: torch.Tensor) -> bool:
    """Unit stride in one of the last two dims and 16-byte-aligned pointer and other strides."""
    item = t.element_size()
    if not _base_aligned(t):
        return False
    row_stride, col_stride = t.stride(-2), t.stride(-1)
    if col_stride == 1:
        outer = [row_stride] + list(t.stride()[:-2])
    elif row_stride == 1:
        outer = [col_stride] + list(t.stride()[:-2])
    else:
        return False
    return all((s * item) % _ALIGN_BYTES == 0 for s in outer)


def supports_fast_path(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> bool:
    """Whether F.grouped_mm accepts these operands (checked without calling it)."""
    if _FAST_KERNEL is None or x_ND.dtype != w_EDF.dtype or x_ND.device != w_EDF.device:
        return False
    if x_ND.device.type == "cuda":
        if x_ND.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x_ND.device) < (9, 0):
            return False
    elif x_ND.device.type == "cpu":
        if x_ND.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if torch.compiler.is_compiling() and x_ND.dtype != torch.bfloat16:
            return False  # the traced op's shape function accepts bf16 only (torch 2.11-2.13)
    else:
        return False
    out_row_bytes = w_EDF.shape[-1] * w_EDF.element_size()
    return x_ND.stride(-1) == 1 and _aligned(x_ND) and _aligned(w_EDF) and out_row_bytes % _ALIGN_BYTES == 0


def _standard_strides(grad_NF: torch.Tensor) -> torch.Tensor:
    # The kernel's backward rejects the stride-0 gradients that e.g. `y.sum()` produces.
    if grad_NF.stride() == (grad_NF.shape[1], 1):
        return grad_NF
    return grad_NF.clone(memory_format=torch.contiguous_format)


def matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `t` computes in: autocast's for float32 where autocast is on, else t's."""
    device_type = t.device.type
    if t.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


def _autocast(t: torch.Tensor) -> torch.Tensor:
    dtype = matmul_dtype(t)
    return t if dtype == t.dtype else t.to(dtype)


def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """y[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]; offs_E are int32 cumulative row ends."""
    x_ND, w_EDF = _autocast(x_ND), _autocast(w_EDF)
    if not supports_fast_path(x_ND, w_EDF):
        return grouped_mm_reference(x_ND, w_EDF, offs_E)
    y_NF = _FAST_KERNEL(x_ND, w_EDF, offs=offs_E.to(torch.int32))
    if y_NF.requires_grad and not torch.compiler.is_compiling():  # (a traced backward makes its own)
        y_NF.register_hook(_standard_strides)
    return y_NF
