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


def _kernel(stored, inplace=()):
    """A codegen kernel with `stored` output buffers and the names in `inplace` held by one
    in-place argument."""
    held = SimpleNamespace(inner_name="in_out_ptr0")
    args = SimpleNamespace(output_buffers=dict.fromkeys(stored, "out_ptr0"), inplace_buffers=dict.fromkeys(inplace, held))
    return SimpleNamespace(args=args, loads=_Lines())


def test_a_load_of_a_buffer_the_kernel_stored_comes_after_a_barrier():
    loaded = []
    load = inductor_reloads.with_barrier_before_reloads(lambda kernel, name, index: loaded.append(name) or "tmp0")
    kernel = _kernel(stored=["buf34"])
    assert load(kernel, "buf34", "r0_1 + 256*x0") == "tmp0"
    assert kernel.loads.lines == [inductor_reloads.BARRIER]
    assert load(kernel, "primals_1", "r0_1 + 256*x0") == "tmp0"  # an input: no barrier
    assert kernel.loads.lines == [inductor_reloads.BARRIER]
    assert loaded == ["buf34", "primals_1"]


def test_an_inplace_buffer_is_loaded_after_a_barrier_only_once_the_kernel_has_stored_to_it():
    load = inductor_reloads.with_barrier_before_reloads(lambda kernel, name, index: "tmp0")
    store = inductor_reloads.remembering_inplace_stores(lambda kernel, name, index, value, mode=None: None)
    kernel = _kernel(stored=[], inplace=["buf5", "buf7"])  # buf7 overwrites buf5 in place
    load(kernel, "buf5", "r0_1")  # the input it still holds: no barrier
    assert kernel.loads.lines == []
    store(kernel, "primals_2", "r0_1", "tmp1")  # not in place: changes nothing
    load(kernel, "buf5", "r0_1")
    assert kernel.loads.lines == []
    store(kernel, "buf7", "r0_1", "tmp1")
    load(kernel, "buf5", "r0_1")  # another name of the memory just stored: a reload
    assert kernel.loads.lines == [inductor_reloads.BARRIER]


def test_install_wraps_inductors_triton_load_once_and_keys_its_cache():
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen.triton import TritonKernel

    wrapped = ("load", "store", "store_reduction")
    saved = {name: getattr(TritonKernel, name) for name in wrapped}
    saved_pass = inductor_config.post_grad_custom_post_pass
    inductor_reloads.install.cache_clear()
    try:
        inductor_config.post_grad_custom_post_pass = None
        inductor_reloads.install()
        inductor_reloads.install()
        for name in wrapped:  # wrapped once, around the original
            assert getattr(TritonKernel, name).__wrapped__ is saved[name], name
        assert "barrier" in inductor_config.post_grad_custom_post_pass.uuid()
    finally:
        for name in wrapped:
            setattr(TritonKernel, name, saved[name])
        inductor_config.post_grad_custom_post_pass = saved_pass
        inductor_reloads.install.cache_clear()
