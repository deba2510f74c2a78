"""Expert parallelism on spawned CPU ranks (gloo), against the single-device MoELayer.

For every (ep, etp) grid of a world (edp = world / (ep*etp); expert rank = etp_i + etp*(ep_i +
ep*edp_i)) and both dispatchers:
- round trip: gate 1 on one copy (0 on the others), identity experts => x back, upstream grad back;
- provenance: rows tagged (source rank, token) land, expert-major, on the rank owning the expert;
- parity: the parallelized layer vs the single-device layer built from the same weights, each rank
  feeding its own slice of one global token set: outputs, input / gate grads, expert grads gathered
  to full shape and summed over edp, other grads summed over the world; all-to-all == all-gather;
- routings: the router's own, all tokens to one expert, k=1, k=E; rank 1 always has no tokens;
- token split: tokens replicated over a 2-rank group, each rank routing half through the layer's
  `SplitTokens`, as the tensor-parallel layouts run it (world 4).
One spawn per world size: starting ranks, not the checks, dominates the time.
"""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dyad.layout import LLMLayout, validate_llm_layout
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.llm_service.expert_parallel import (
    DISPATCHERS,
    EXPERT_TP_DIM,
    SplitTokens,
    expert_param_names,
    parallelize_moe,
)
from dyad.llm_service.moe import MoELayer
from dyad.llm_service.moe_dispatch import LocalDispatcher
from dyad.parallel.gradients import gather_full
from tests.helpers.distributed import run_distributed

GRIDS = {4: [(4, 1), (2, 2), (2, 1)], 8: [(8, 1), (4, 2), (2, 2)]}  # (ep, etp)
DIM, NUM_EXPERTS = 8, 8
CFG = MoEConfig(num_experts=NUM_EXPERTS, top_k=2, expert_dim=16, shared_expert_dim=8)
ROUTINGS = ("router", "one_expert", "k1", "kE")  # "router": the layer routes (top_k=2)
TOP_K = {"one_expert": 1, "k1": 1, "kE": NUM_EXPERTS}


def _num_tokens(rank: int) -> int:
    return 0 if rank == 1 else 2 + rank


def _token_rows(rank: int) -> slice:
    start = sum(_num_tokens(r) for r in range(rank))
    return slice(start, start + _num_tokens(rank))


def _routing(kind: str, rank: int) -> torch.Tensor:
    """expert_idx_TK of `rank`'s tokens ("router": random top-2); every rank can recompute any rank's."""
    T = _num_tokens(rank)
    if kind == "one_expert":
        return torch.full((T, 1), NUM_EXPERTS - 1)
    g = torch.Generator().manual_seed(100 * ROUTINGS.index(kind) + rank)
    return torch.rand(T, NUM_EXPERTS, generator=g).topk(TOP_K.get(kind, 2), dim=1).indices


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _full_layer(cfg: MoEConfig = CFG) -> MoELayer:
    """The same weights on every rank; larger than the default init so that the routed experts,
    not the shared expert, dominate outputs and gradients."""
    torch.manual_seed(0)
    layer = MoELayer(DIM, cfg)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.5)
    return layer


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    err, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert err <= 1e-5 * scale + 1e-12, f"{what}: max error {err:.3g} at scale {scale:.3g}"


@dataclass
class Grid:
    ep: int
    etp: int
    ep_group: dist.ProcessGroup
    etp_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup
    block: list[int]  # ranks of this rank's edp index: the ranks whose tokens it may compute

    @property
    def local_experts(self) -> range:
        num_local = NUM_EXPERTS // self.ep
        first = dist.get_rank(self.ep_group) * num_local
        return range(first, first + num_local)


def _build_grid(world: int, ep: int, etp: int) -> Grid:
    """Every rank creates every group, in the same order, and keeps its own."""
    edp = world // (ep * etp)

    def rank_of(q, p, d):
        return q + etp * (p + ep * d)

    lists = {
        "etp": [[rank_of(q, p, d) for q in range(etp)] for d in range(edp) for p in range(ep)],
        "ep": [[rank_of(q, p, d) for p in range(ep)] for d in range(edp) for q in range(etp)],
        "edp": [[rank_of(q, p, d) for d in range(edp)] for p in range(ep) for q in range(etp)],
    }
    rank, mine = dist.get_rank(), {}
    for axis, groups in lists.items():
        for members in groups:
            group = dist.new_group(members)
            if rank in members:
                mine[axis] = group
    d = rank // (etp * ep)
    block = [rank_of(q, p, d) for p in range(ep) for q in range(etp)]
    return Grid(ep, etp, mine["ep"], mine["etp"], mine["edp"], block)


def _check_round_trip(grid: Grid, dispatcher: str, kind: str, rank: int) -> None:
    expert_idx_TK = _routing(kind, rank)
    T, K = expert_idx_TK.shape
    x_TD = _randn(T, DIM, seed=rank).requires_grad_()
    gates_TK = torch.zeros(T, K)
    gates_TK[:, 0] = 1.0  # the other copies are "dropped": they still travel
    d = DISPATCHERS[dispatcher](grid.ep_group, NUM_EXPERTS, grid.etp_group)
    x_local_MD, counts_L, handle = d.dispatch(x_TD, expert_idx_TK)
    assert x_local_MD.shape[0] == int(counts_L.sum())
    y_TD = d.combine(x_local_MD / grid.etp, gates_TK, handle)  # each etp rank: a 1/etp partial
    upstream_TD = _randn(T, DIM, seed=100 + rank)
    y_TD.backward(upstream_TD)
    assert torch.equal(y_TD, x_TD), f"{dispatcher} {kind}: round trip changed x"
    assert torch.equal(x_TD.grad, upstream_TD), f"{dispatcher} {kind}: input grad != upstream grad"


def _check_provenance(grid: Grid, dispatcher: str, kind: str, rank: int) -> None:
    T = _num_tokens(rank)
    tags_T2 = torch.stack([torch.full((T,), float(rank)), torch.arange(T, dtype=torch.float32)], dim=1)
    d = DISPATCHERS[dispatcher](grid.ep_group, NUM_EXPERTS, grid.etp_group)
    tags_M2, counts_L, _ = d.dispatch(tags_T2, _routing(kind, rank))
    experts = grid.local_experts
    expert_M = experts.start + torch.repeat_interleave(torch.arange(len(experts)), counts_L)
    got = sorted(zip(expert_M.tolist(), *tags_M2.long().T.tolist()))
    want = sorted(
        (e, src, t)
        for src in grid.block
        for t, row in enumerate(_routing(kind, src).tolist())
        for e in row
        if e in experts
    )
    assert got == want, f"{dispatcher} {kind}: received {got}, expected {want}"


def _forward_backward(layer: MoELayer, kind: str, x_TD, gates_TK, expert_idx_TK, upstream_TD):
    """Through the whole layer ("router") or straight through routed_experts with given routing."""
    x_TD = x_TD.clone().requires_grad_()
    if kind == "router":
        y_TD, _ = layer(x_TD)
    else:
        gates_TK = gates_TK.clone().requires_grad_()
        y_TD = layer.routed_experts(x_TD, gates_TK, expert_idx_TK)
    (y_TD * upstream_TD).sum().backward()
    gates_grad = gates_TK.grad if kind != "router" else None
    return y_TD.detach(), x_TD.grad, gates_grad


def _global_inputs(kind: str, world: int):
    num_tokens = sum(_num_tokens(r) for r in range(world))
    expert_idx_TK = torch.cat([_routing(kind, r) for r in range(world)])
    gates_TK = torch.rand(num_tokens, expert_idx_TK.shape[1], generator=torch.Generator().manual_seed(7))
    return _randn(num_tokens, DIM, seed=1), gates_TK, expert_idx_TK, _randn(num_tokens, DIM, seed=2)


def _reference(kind: str, world: int):
    full = _full_layer()
    outputs = _forward_backward(full, kind, *_global_inputs(kind, world))
    return full, outputs


def _check_grads(par: MoELayer, full: MoELayer, grid: Grid, replicas: int, what: str) -> None:
    """Expert grads: gathered to full shape, summed over edp. Others: summed over the world, where
    `replicas` ranks hold the same tokens and so the same replicated gradient."""
    for name, param in par.named_parameters():
        expected = dict(full.named_parameters())[name].grad
        if expected is None:  # routed_experts alone: no router / shared-expert gradient
            assert param.grad is None, f"{what}: {name} has a gradient"
            continue
        if name in EXPERT_TP_DIM:
            grad = gather_full(par, name, param.grad)
            dist.all_reduce(grad, group=grid.edp_group)
        else:
            grad = param.grad.clone()
            dist.all_reduce(grad)
            grad /= replicas
        _close(grad, expected, f"{what}: grad of {name}")


def _check_parity(grid: Grid, kind: str, rank: int, world: int, reference) -> None:
    full, (y_ref, x_grad_ref, gates_grad_ref) = reference
    x_TD, gates_TK, expert_idx_TK, upstream_TD = (t[_token_rows(rank)] for t in _global_inputs(kind, world))
    outputs = {}
    for dispatcher in DISPATCHERS:
        what = f"ep{grid.ep} etp{grid.etp} {dispatcher} {kind}"
        par = copy.deepcopy(full)
        par.zero_grad(set_to_none=True)
        parallelize_moe(par, ep_group=grid.ep_group, etp_group=grid.etp_group, dispatcher=dispatcher)
        num_local = NUM_EXPERTS // grid.ep
        assert par.w13_ED2F.shape == (num_local, DIM, 2 * CFG.expert_dim // grid.etp), what
        assert par.w2_EFD.shape == (num_local, CFG.expert_dim // grid.etp, DIM), what
        y_TD, x_grad, gates_grad = _forward_backward(par, kind, x_TD, gates_TK, expert_idx_TK, upstream_TD)
        _close(y_TD, y_ref[_token_rows(rank)], f"{what}: output")
        _close(x_grad, x_grad_ref[_token_rows(rank)], f"{what}: input grad")
        if gates_grad is not None:
            _close(gates_grad, gates_grad_ref[_token_rows(rank)], f"{what}: gate grad")
        _check_grads(par, full, grid, 1, what)
        outputs[dispatcher] = (y_TD, x_grad)
    (y_a2a, xg_a2a), (y_ag, xg_ag) = outputs["alltoall"], outputs["allgather"]
    _close(y_ag, y_a2a, f"ep{grid.ep} etp{grid.etp} {kind}: all-gather vs all-to-all output")
    _close(xg_ag, xg_a2a, f"ep{grid.ep} etp{grid.etp} {kind}: all-gather vs all-to-all input grad")


def _check_token_split(grid: Grid, split_axis: str, rank: int) -> None:
    """Tokens identical on the 2 ranks of `split_axis`'s group (replica r holds block r of X), each
    rank routing its half as tensor parallelism splits them (`SplitTokens`, the stats summed over
    the pair); the pairs' token counts differ."""
    split_group = {"ep": grid.ep_group, "etp": grid.etp_group}[split_axis]
    replica = rank // 2  # the 2-rank ep / etp groups of these grids are {0, 1} and {2, 3}
    sizes = [8, 2]  # the second replica's two tokens leave each rank of its pair one
    rows = slice(sum(sizes[:replica]), sum(sizes[: replica + 1]))
    X_TD, upstream_TD = _randn(sum(sizes), DIM, seed=3), _randn(sum(sizes), DIM, seed=4)
    full = _full_layer()
    y_ref, x_grad_ref, _ = _forward_backward(full, "router", X_TD, None, None, upstream_TD)
    for dispatcher in DISPATCHERS:
        what = f"ep{grid.ep} etp{grid.etp} {dispatcher} split over {split_axis}"
        par = copy.deepcopy(full)
        par.zero_grad(set_to_none=True)
        parallelize_moe(par, ep_group=grid.ep_group, etp_group=grid.etp_group, dispatcher=dispatcher)
        par.stats_group, par.tokens = split_group, SplitTokens(split_group, 2)
        y_TD, x_grad, _ = _forward_backward(par, "router", X_TD[rows], None, None, upstream_TD[rows])
        _close(y_TD, y_ref[rows], f"{what}: output")
        _close(x_grad, x_grad_ref[rows], f"{what}: input grad")
        _check_grads(par, full, grid, 1, what)  # every rank routes its own tokens: no replicas


def test_degrees_that_do_not_fit_the_experts_are_refused_by_the_layout():
    llm = LLMConfig(vocab_size=32, moe=MoEConfig(num_experts=6))
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by ep \(4\)"):
        validate_llm_layout(LLMLayout(dp=4, ep=4), llm)
    llm = LLMConfig(vocab_size=32, moe=MoEConfig(expert_dim=15))
    with pytest.raises(ValueError, match=r"etp \(2\) must divide moe.expert_dim \(15\)"):
        validate_llm_layout(LLMLayout(dp=4, ep=2, etp=2), llm)


def _check_config_errors(grids: dict) -> None:
    with pytest.raises(ValueError, match="dispatcher 'ring'"):
        parallelize_moe(_full_layer(), ep_group=grids[4, 1].ep_group, dispatcher="ring")


def _all_checks(rank: int, world: int) -> None:
    grids = {(ep, etp): _build_grid(world, ep, etp) for ep, etp in GRIDS[world]}
    references = {kind: _reference(kind, world) for kind in ROUTINGS}
    for grid in grids.values():
        for dispatcher in DISPATCHERS:
            for kind in ROUTINGS:
                _check_round_trip(grid, dispatcher, kind, rank)
                _check_provenance(grid, dispatcher, kind, rank)
        for kind in ROUTINGS:
            _check_parity(grid, kind, rank, world, references[kind])
    if world == 4:
        _check_token_split(grids[2, 1], "ep", rank)
        _check_token_split(grids[2, 2], "etp", rank)
        _check_config_errors(grids)


@pytest.mark.parametrize("world", [4, 8])
def test_expert_parallel(world):
    run_distributed(_all_checks, world)


def test_local_dispatcher_is_the_layers_routed_experts():
    layer = _full_layer()
    x_TD, gates_TK, expert_idx_TK, _ = _global_inputs("kE", 4)
    d = LocalDispatcher(NUM_EXPERTS)
    x_sorted_ND, counts_E, handle = d.dispatch(x_TD, expert_idx_TK)
    y_TD = d.combine(layer.experts(x_sorted_ND, counts_E), gates_TK, handle)
    torch.testing.assert_close(y_TD, layer.routed_experts(x_TD, gates_TK, expert_idx_TK), rtol=0, atol=0)


def test_expert_param_names():
    model = nn.ModuleDict({"embed": nn.Linear(DIM, DIM), "blocks": nn.ModuleList([_full_layer(), _full_layer()])})
    names = expert_param_names(model)
    assert names == {f"blocks.{i}.{n}" for i in range(2) for n in ("w13_ED2F", "w2_EFD")}
    assert names <= dict(model.named_parameters()).keys()
