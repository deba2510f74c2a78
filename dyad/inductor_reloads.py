"""A barrier before every load of a buffer that the same inductor Triton kernel stored earlier.

Inductor fuses a looped reduction and the pointwise work that needs its result into one kernel:
the first loop stores a row's values (when a later kernel needs them too) and reduces them, the
second loop loads them back and uses the reduction. Inductor assumes each thread loads back what
it stored itself. Triton does not promise that: it may give a load and the store before it
different thread layouts, so that another thread stores the value a thread loads, and nothing
orders the two (what the measurements below show; a barrier makes them right). On an H200 with torch 2.11 this happened in the MoE block's backward
(the ffn norm's backward fused with the residual and the experts' gathered input gradients):
relaunched alone on the same inputs the kernel's results were 1e-2 apart with its stored buffer
zeroed first and 5e7 apart with it filled with 1e4, and the LLM's compiled bf16 gradients were
10-50 % off float32 where eager's are 1.2 % (docs/performance.md, "Compiled bf16 gradients on a
GPU"). `tl.debug_barrier()` (a CTA-wide barrier, which also orders the threads' global memory
accesses) before such a load makes every thread's stores visible to it.

`install()` wraps inductor's Triton kernel codegen `load` (process-wide, idempotent) and, where no
other post-grad pass is set, tags inductor's graph cache key, so graphs compiled without the
barrier are not reused. Loads served
from inductor's store cache (the same loop, the value still in registers) are untouched.
"""

from __future__ import annotations

import functools

BARRIER = "tl.debug_barrier()"


@functools.cache
def install() -> None:
    """Patch inductor's Triton codegen (once per process)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen.triton import TritonKernel

    TritonKernel.load = with_barrier_before_reloads(TritonKernel.load)
    if inductor_config.post_grad_custom_post_pass is None:
        inductor_config.post_grad_custom_post_pass = _cache_tag()


def with_barrier_before_reloads(load):
    """`load` (a Triton kernel codegen's `load(kernel, name, index)`), writing BARRIER into the
    kernel's loads first where it reloads its own store."""

    @functools.wraps(load)
    def load_after_barrier(kernel, name, index):
        if reloads_own_store(kernel, name):
            kernel.loads.writeline(BARRIER)
        return load(kernel, name, index)

    return load_after_barrier


def reloads_own_store(kernel, name: str) -> bool:
    """Whether `kernel` loads `name` from memory after storing it itself (the store cache, which
    serves loads in the same loop from registers, is consulted before this load is reached)."""
    return name in kernel.args.output_buffers


def _cache_tag():
    """A no-op post-grad pass whose uuid enters inductor's cache key (its documented way of
    keying compiled graphs on custom passes)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ReloadBarrierTag(CustomGraphPass):
        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> str:
            return "dyad.inductor_reloads: barrier before reloading an own store, v1"

    return ReloadBarrierTag()
