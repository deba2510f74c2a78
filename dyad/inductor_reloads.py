"""A barrier before every load of a buffer that the same inductor Triton kernel stored earlier.

Inductor fuses a looped reduction and the pointwise work that needs its result into one kernel:
the first loop stores a row's values (when a later kernel needs them too) and reduces them, the
second loop loads them back and uses the reduction. Inductor assumes each thread loads back what
it stored itself. Triton does not promise that: it may give a load and the store before it
different thread layouts, so that another thread stores the value a thread loads, and nothing
orders the two. On an H200 with torch 2.11 this happened in the MoE block's backward (the ffn
norm's backward fused with the residual and the experts' gathered input gradients): relaunched
alone on the same inputs, the kernel's results depended on what its stored buffer held before,
and the LLM's compiled bf16 gradients drifted far from float32 where eager's did not
(docs/performance.md, "Compiled bf16 gradients on a GPU"). `tl.debug_barrier()` (a CTA-wide
barrier, which also orders the threads' global memory accesses) before such a load makes every
thread's stores visible to it.

Which loads: those of the kernel's output buffers (stored before any load of them: an output is
registered by its store), and those of an in-place buffer (`in_out_ptr`, an input the kernel
overwrites) after the kernel has stored to it; the first load of an in-place buffer, of the input
it still holds, needs none. No race was seen through an in-place buffer; the rule is the same
memory ordering, so it covers them too.

`install()` wraps inductor's Triton kernel codegen `load`, `store` and `store_reduction`
(process-wide, idempotent) and, where no other post-grad pass is set, tags inductor's graph cache
key, so graphs compiled without the barrier are not reused. Loads served from inductor's store
cache (the same loop, the value still in registers) are untouched.
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
    TritonKernel.store = remembering_inplace_stores(TritonKernel.store)
    TritonKernel.store_reduction = remembering_inplace_stores(TritonKernel.store_reduction)
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


def remembering_inplace_stores(store):
    """`store` (a Triton kernel codegen's `store(kernel, name, index, value, ...)` or
    `store_reduction`), noting which in-place buffers the kernel has stored to."""

    @functools.wraps(store)
    def store_and_remember(kernel, name, *args, **kwargs):
        result = store(kernel, name, *args, **kwargs)
        inplace = _inplace_arg(kernel, name)
        if inplace is not None:
            kernel.__dict__.setdefault("_dyad_stored_inplace", set()).add(inplace)
        return result

    return store_and_remember


def reloads_own_store(kernel, name: str) -> bool:
    """Whether `kernel` loads `name` from memory after storing it itself (the store cache, which
    serves loads in the same loop from registers, is consulted before this load is reached)."""
    if name in kernel.args.output_buffers:
        return True
    inplace = _inplace_arg(kernel, name)
    return inplace is not None and inplace in kernel.__dict__.get("_dyad_stored_inplace", ())


def _inplace_arg(kernel, name: str) -> str | None:
    """The `in_out_ptr` argument that holds `name`, if the kernel holds it in place (every name
    of one in-place buffer maps to its one argument)."""
    from torch._inductor.virtualized import V

    scheduler = getattr(V.graph, "scheduler", None)  # as KernelArgs does: a mutation's real buffer
    if scheduler is not None:
        name = scheduler.mutation_real_name.get(name, name)
    return getattr(kernel.args.inplace_buffers.get(name), "inner_name", None)


def _cache_tag():
    """A no-op post-grad pass whose uuid enters inductor's cache key (its documented way of
    keying compiled graphs on custom passes)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ReloadBarrierTag(CustomGraphPass):
        def __call__(self, graph) -> None:
            """Leaves the graph as it is: the pass exists for its uuid."""

        def uuid(self) -> str:
            return "dyad.inductor_reloads: barrier before reloading an own store, in-place ones too, v2"

    return ReloadBarrierTag()
