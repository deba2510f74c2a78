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

Under torch.compile a block's side effects on its modules (the MoE layer keeps its last expert
counts) happen in the forward and are not replayed by the recomputation: without
`skip_fwd_side_effects_in_bwd_under_checkpoint` dynamo breaks the graph there and runs the whole
MoE block eagerly (measured on two H100s: a dp2 step recomputing both pools took 1.8-1.9x one
recomputing the encoder's only). Eagerly they are replayed, which is why
`train.recompute` refuses the LLM when its MoE layers count tokens for their expert biases.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from dyad.compile import transformer_blocks


def recompute_blocks(model: nn.Module) -> int:
    """Make every transformer block of `model` recompute its activations in the backward pass;
    returns how many blocks."""
    import torch._dynamo

    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    blocks = transformer_blocks(model)
    for block in blocks:
        if isinstance(block.forward, functools.partial):
            raise ValueError(f"{type(block).__name__} blocks of {type(model).__name__} already recompute")
        block.forward = functools.partial(_recomputed, block.forward)
    return len(blocks)


def _recomputed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
