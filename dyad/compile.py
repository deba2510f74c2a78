"""`train.compile`: each transformer block of a pool's model compiled with torch.compile.

Applied from outside, after the model is parallelized for its rank, like every other layout
change. A block's many small kernels (norms, rotary, routing, SwiGLU, autocast's weight casts)
fuse, and one compiled call replaces hundreds of eager launches: the LLM step is host-bound
without it (docs/performance.md). Blocks of the same kind share one compiled graph; a new
sequence length recompiles once, after which lengths are symbolic; that step takes seconds
longer, and the worker's log names the guard that failed (`log_recompiles`). The collectives inside a
block are traced as torch's functional collectives (`dyad/parallel/collectives.py`, which says
why); the expert-parallel dispatcher's one host sync splits its block's graph there. Checked
on torch 2.11 (the GPU hosts') and 2.13 (CI's): on 2.11 a traced autograd.Function's backward
is lost, silently, where its forward returns a tensor that a no-op cast or an in-place c10d
collective produced (`dyad/kernels/traceable.py`, `dyad/parallel/collectives.py` avoid both).
Compiling is for GPUs in bf16: in float32 on CPUs the grouped matmul falls back to a loop over
the experts' row counts, left out of dynamo's graphs (traced, it would recompile for every new
count): still the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from dyad import inductor_reloads


def compile_backends() -> list[str]:
    """Every backend torch.compile knows, the debugging ones ("aot_eager") included."""
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a VisionEncoder (`blocks`) or MoELM (`layers`)."""
    for name in ("layers", "blocks"):
        blocks = getattr(model, name, None)
        if isinstance(blocks, nn.ModuleList):
            return blocks
    raise TypeError(f"{type(model).__name__} has no transformer blocks ('layers' or 'blocks') to compile")


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every transformer block of `model` in place, and each of its modules that asks to
    be compiled with them (`compiled_with_blocks = True`: the LLM's caption loss, whose float32
    cast and softmax then fuse); returns how many blocks. With inductor, its Triton kernels first
    get a barrier before reloading what they stored (`dyad/inductor_reloads.py`: without it the
    LLM's compiled bf16 gradients were wrong)."""
    if backend == "inductor":
        inductor_reloads.install()
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(backend=backend)
    for module in model.modules():
        if getattr(module, "compiled_with_blocks", False):
            module.compile(backend=backend)
    return len(blocks)


def log_recompiles() -> None:
    """Have torch log every recompile and the guard that failed ("size mismatch at index 1.
    expected 521, actual 263") to the process's stderr, which is its worker's log: a step that
    recompiles takes seconds longer, and the log says why. TORCH_LOGS, when set, takes precedence
    (torch ignores this call then)."""
    torch._logging.set_logs(recompiles=True)
