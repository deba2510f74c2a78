"""`train.recompute`: a pool's transformer blocks keep only their inputs through the forward pass
and run their forward again in the backward pass (activation recomputation).

Applied from outside, after the model is parallelized and before its blocks are compiled (so
torch.compile traces the recomputation along with the block, as torchtitan orders the two). Each
block's forward is wrapped on the instance, so parameter names, checkpoints and the optimizer see
the same model. Uses torch.utils.checkpoint without reentrancy: the forward's own autograd graph
is kept and only the tensors it would save are dropped and rebuilt, so the gradients are the
eager ones (the same kernels on the same inputs), at the cost of one more forward pass of each
block. Memory falls from every block's saved activations to one block's at a time plus each
block's input.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from dyad.compile import transformer_blocks


def recompute_blocks(model: nn.Module) -> int:
    """Make every transformer block of `model` recompute its activations in the backward pass;
    returns how many blocks."""
    blocks = transformer_blocks(model)
    for block in blocks:
        if isinstance(block.forward, functools.partial):
            raise ValueError(f"{type(block).__name__} blocks of {type(model).__name__} already recompute")
        block.forward = functools.partial(_recomputed, block.forward)
    return len(blocks)


def _recomputed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
