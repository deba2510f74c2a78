"""Which compiler setting brings the compiled bf16 gradients back?"""
import os, sys
import torch
import torch._functorch.config as fc
import torch._inductor.config as ic
sys.path.insert(0, os.path.dirname(__file__))
import floor2
from floor2 import setup, run, report
base, inputs = setup()
truth = run(base, inputs, False)
report("compiled both, default", run(base, inputs, True, (0, 1)), truth)
with fc.patch(donated_buffer=False):
    report("compiled both, donated_buffer=False", run(base, inputs, True, (0, 1)), truth)
with ic.patch(allow_buffer_reuse=False):
    report("compiled both, allow_buffer_reuse=False", run(base, inputs, True, (0, 1)), truth)
with fc.patch(enable_autograd_cache=False), ic.patch(fx_graph_cache=False):
    report("compiled both, no caches", run(base, inputs, True, (0, 1)), truth)
floor2.backend = "aot_eager"
report("compiled both, aot_eager", run(base, inputs, True, (0, 1)), truth)
floor2.backend = "inductor"
report("compiled both, default again", run(base, inputs, True, (0, 1)), truth)
