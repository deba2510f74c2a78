"""The modules of Triton kernels beside the fast paths (`dyad/kernels/*_triton.py`), imported only
where Triton is: a CPU-only install has no Triton, and there every fast path falls back to its
plain-PyTorch reference."""

import functools
import importlib


@functools.cache
def triton_module(name: str):
    """`dyad.kernels.<name>`, a module of Triton kernels, or None without Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return importlib.import_module(f"dyad.kernels.{name}")
