"""dyad/inductor_reloads.py: the barrier inductor's Triton kernels get before reloading what they
stored. Whether it fixes the compiled gradients needs a GPU: test_compile.py's
test_inductor_blocks_gradients_are_as_close_to_float32_as_eager_bf16s_on_a_gpu."""

from types import SimpleNamespace

from dyad import inductor_reloads


class _Lines:
    def __init__(self):
        self.lines = []

    def writeline(self, line):
        self.lines.append(line)


def _kernel(stored):
    return SimpleNamespace(args=SimpleNamespace(output_buffers=dict.fromkeys(stored, "out_ptr0")), loads=_Lines())


def test_a_load_of_a_buffer_the_kernel_stored_comes_after_a_barrier():
    loaded = []
    load = inductor_reloads.with_barrier_before_reloads(lambda kernel, name, index: loaded.append(name) or "tmp0")
    kernel = _kernel(stored=["buf34"])
    assert load(kernel, "buf34", "r0_1 + 256*x0") == "tmp0"
    assert kernel.loads.lines == [inductor_reloads.BARRIER]
    assert load(kernel, "primals_1", "r0_1 + 256*x0") == "tmp0"  # an input: no barrier
    assert kernel.loads.lines == [inductor_reloads.BARRIER]
    assert loaded == ["buf34", "primals_1"]


def test_install_wraps_inductors_triton_load_once_and_keys_its_cache():
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen.triton import TritonKernel

    saved_load, saved_pass = TritonKernel.load, inductor_config.post_grad_custom_post_pass
    inductor_reloads.install.cache_clear()
    try:
        inductor_config.post_grad_custom_post_pass = None
        inductor_reloads.install()
        inductor_reloads.install()
        assert TritonKernel.load.__wrapped__ is saved_load  # wrapped once, around the original
        assert "barrier" in inductor_config.post_grad_custom_post_pass.uuid()
    finally:
        TritonKernel.load, inductor_config.post_grad_custom_post_pass = saved_load, saved_pass
        inductor_reloads.install.cache_clear()
