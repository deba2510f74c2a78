"""`train.recompute`: a pool's transformer blocks keep only their inputs through the forward pass
and run their forward again in the backward pass (activation recomputation).

Applied from outside, after the model is parallelized and before its blocks are compiled (so
torch.compile traces the recomputation along with the block, as torchtitan orders the two): each
block is replaced by a `RecomputedBlock` wrapping it, whose parameters, buffers and submodules
are the block's own under the same names, so parameter names, checkpoints and the optimizer see
the same model. Uses torch.utils.checkpoint without reentrancy: the forward's own autograd graph
is kept and only the tensors it would save are dropped and rebuilt, so the gradients are the
eager ones (the same kernels on the same inputs), at the cost of one more forward pass of each
block. Memory falls from every block's saved activations to one block's at a time plus each
block's input.

A block's side effects happen once, in the forward pass: eagerly the recomputation runs under
`recomputing()`, which the MoE layer reads to leave its token counts (for the expert biases)
alone; under torch.compile dynamo does not replay them
(`skip_fwd_side_effects_in_bwd_under_checkpoint`: without it dynamo breaks the graph at the MoE
layer's side effect and runs the whole MoE block eagerly, which makes a recomputing LLM pool
far slower).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dyad.compile import transformer_blocks


class RecomputedBlock(nn.Module):
    """A block that keeps only its inputs through the forward pass and runs its forward again in
    the backward pass. It holds the block without registering it as a child (which would prefix
    every name with the child's) and shares the block's parameters, buffers and submodules, the
    same dicts: every name, state-dict key and checkpoint entry is the block's own."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self._parameters, self._buffers, self._modules = block._parameters, block._buffers, block._modules
        self._non_persistent_buffers_set = block._non_persistent_buffers_set
        self.__dict__["block"] = block
        self.training = block.training

    def train(self, mode: bool = True):
        self.block.training = mode
        return super().train(mode)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo takes no context_fn but selective checkpointing's
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return checkpoint(
            self.block, *args, use_reentrant=False, context_fn=_forward_and_recomputation_contexts, **kwargs
        )


def recompute_blocks(model: nn.Module) -> int:
    """Replace every transformer block of `model` with a `RecomputedBlock` of it; returns how
    many blocks."""
    import torch._dynamo

    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    blocks = transformer_blocks(model)
    if any(isinstance(block, RecomputedBlock) for block in blocks):
        raise ValueError(f"{type(model).__name__}'s blocks already recompute")
    for index, block in enumerate(blocks):
        blocks[index] = RecomputedBlock(block)
    return len(blocks)


_state = threading.local()  # set and read on the thread that recomputes (on a GPU, autograd's device thread)


def recomputing() -> bool:
    """True while an eager block runs its forward again in the backward pass."""
    return getattr(_state, "recomputing", False)


@contextlib.contextmanager
def _recomputation():
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = False


def _forward_and_recomputation_contexts():
    return contextlib.nullcontext(), _recomputation()

