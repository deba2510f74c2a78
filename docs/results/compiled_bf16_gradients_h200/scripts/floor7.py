"""Deterministic algorithms in the forward only or in the backward only; and dumps for a diff."""
import copy, os, sys
import torch
sys.path.insert(0, os.path.dirname(__file__))
import floor2
from floor2 import setup, run, report
from tests.test_recompute import _llm_loss
base, inputs = setup()
mode = sys.argv[1]

def phased(det_fwd, det_bwd):
    m = copy.deepcopy(base)
    for i in (0, 1): m.layers[i].compile()
    for _ in range(2):
        m.zero_grad(set_to_none=True)
        torch.use_deterministic_algorithms(det_fwd)
        loss = _llm_loss(m, inputs, True)
        torch.use_deterministic_algorithms(det_bwd)
        loss.backward()
        torch.use_deterministic_algorithms(False)
    torch._dynamo.reset()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters()}

if mode == "phases":
    truth = run(base, inputs, False)
    report("compiled both, deterministic in forward only", phased(True, False), truth)
    report("compiled both, deterministic in backward only", phased(False, True), truth)
    report("compiled both, deterministic in both", phased(True, True), truth)
    report("compiled both, deterministic in neither", phased(False, False), truth)
elif mode == "only1":
    truth = run(base, inputs, False)
    report("only layer 1 compiled (dumped)", run(base, inputs, True, (1,)), truth)
