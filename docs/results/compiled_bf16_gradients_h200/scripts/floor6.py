"""Narrow the compiled bf16 gradient error down: parts left out of the compiled graphs, inductor modes."""
import os, sys
import torch
import torch._inductor.config as ic
sys.path.insert(0, os.path.dirname(__file__))
import floor2
from floor2 import setup, run, report
from dyad.llm_service import model as model_lib
from dyad.llm_service import moe as moe_lib
base, inputs = setup()
truth = run(base, inputs, False)
report("compiled both, default", run(base, inputs, True, (0, 1)), truth)
with ic.patch(deterministic=True):
    report("compiled both, inductor deterministic", run(base, inputs, True, (0, 1)), truth)
with ic.patch({"triton.autotune_pointwise": False}):
    report("compiled both, no pointwise autotune", run(base, inputs, True, (0, 1)), truth)
orig = moe_lib.MoELayer.forward
moe_lib.MoELayer.forward = torch.compiler.disable(orig)
report("compiled both, MoE layer eager", run(base, inputs, True, (0, 1)), truth)
moe_lib.MoELayer.forward = orig
orig = model_lib.Attention.forward
model_lib.Attention.forward = torch.compiler.disable(orig)
report("compiled both, attention eager", run(base, inputs, True, (0, 1)), truth)
model_lib.Attention.forward = orig
torch.use_deterministic_algorithms(True)
report("compiled both, deterministic algorithms", run(base, inputs, True, (0, 1)), truth)
