"""Values derived from a weight (its float8 codes, its bfloat16 copy) kept beside it until the
weight changes.

A cached value follows the tensor's version counter, which in-place updates such as a checkpoint
restore bump; fused optimizers update weights without bumping it, so `forget_cached_after_each_step`
drops every parameter's cache after each optimizer step. The microbatches of one step, and a
layer's forward and backward, share one derived value.
"""

from __future__ import annotations

import torch

_CACHE_ATTR = "_dyad_weight_cache"


def cached_per_version(w: torch.Tensor, key, make):
    """make(w), computed once per in-place version of `w` and kept on the tensor."""
    version, entries = getattr(w, _CACHE_ATTR, (None, None))
    if version != w._version:
        version, entries = w._version, {}
        setattr(w, _CACHE_ATTR, (version, entries))
    if key not in entries:
        entries[key] = make(w)
    return entries[key]


def forget_cached(params) -> None:
    """Drop what is cached beside `params` (a module's or an iterable of tensors)."""
    for p in params.parameters() if isinstance(params, torch.nn.Module) else params:
        p.__dict__.pop(_CACHE_ATTR, None)


def forget_cached_after_each_step(optimizer: torch.optim.Optimizer) -> None:
    """Make every `optimizer.step()` drop its parameters' cached values."""

    def forget(opt, args, kwargs):
        forget_cached(p for group in opt.param_groups for p in group["params"])

    optimizer.register_step_post_hook(forget)
