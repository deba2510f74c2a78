"""Float8 training for the LLM, applied from outside the single-device model.

`convert_to_fp8(model)` replaces the attention projections and the dense and shared-expert
SwiGLUs' linears with `Fp8Linear`, and the routed experts' `GroupedSwiGLU` with
`Float8GroupedSwiGLU`: the e4m3 GEMMs of `dyad/kernels/fp8.py` (forward and input gradient in
float8, weight gradients in bf16). The token router stays in float32 and the output head and
embeddings in bf16, as in the usual float8 recipes: they are small and the loss is sensitive to
them. Parameters keep their names and objects, so initialisation, checkpoints and the optimizer
see the same model.
"""

from __future__ import annotations

import torch
from torch import nn

from dyad.kernels.fp8 import fp8_grouped_mm, fp8_linear
from dyad.kernels.gated_experts import gated_experts_reference
from dyad.llm_service.model import Attention
from dyad.llm_service.moe import MoELayer, SwiGLU

_ALIGN = 16  # the float8 GEMMs need both matrix dims divisible by 16


class Fp8Linear(nn.Linear):
    """nn.Linear whose matmul runs in float8 (see dyad/kernels/fp8.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Float8GroupedSwiGLU(nn.Module):
    """The float8 counterpart of `GroupedSwiGLU`: SwiGLU(x @ w13) @ w2 on float8 grouped GEMMs,
    SwiGLU between them (not in their epilogues)."""

    def forward(self, x_sorted_ND, w13_ED2F, w2_EFD, offs_E) -> torch.Tensor:
        return gated_experts_reference(x_sorted_ND, w13_ED2F, w2_EFD, offs_E, fp8_grouped_mm)


def convert_to_fp8(model: nn.Module) -> nn.Module:
    """Swap the model's attention and feed-forward matmuls for float8 ones, in place."""
    for module in list(model.modules()):
        if isinstance(module, MoELayer):
            for name in module.expert_weight_names():
                _check_aligned(module, name, getattr(module, name).shape[1:])
            module.grouped_swiglu = Float8GroupedSwiGLU()
        if isinstance(module, (Attention, SwiGLU)):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    _check_aligned(module, name, child.weight.shape)
                    setattr(module, name, _as_fp8(child))
    return model


def _as_fp8(linear: nn.Linear) -> Fp8Linear:
    fp8 = Fp8Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        device="meta",
    )
    fp8.weight, fp8.bias = linear.weight, linear.bias
    return fp8


def _check_aligned(module: nn.Module, name: str, shape) -> None:
    if any(d % _ALIGN for d in shape):
        raise ValueError(
            f"llm.fp8: {type(module).__name__}.{name} has shape {tuple(shape)}; float8 GEMMs need every "
            f"dim divisible by {_ALIGN} (check llm.dim, llm.dense_ffn_dim, llm.moe.expert_dim, heads)"
        )
