"""Router options of the MoE layer against plain references written here with loops over floats
(no code shared with dyad/llm_service/moe.py). The router weight is the identity, so a token's input
row is its logits.
"""

import math

import pytest
import torch
import torch.distributed as dist

from dyad.init import init_parameters
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.llm_service.model import MoELM
from dyad.llm_service.moe import MoELayer, update_expert_biases
from tests.helpers.distributed import run_distributed
from tests.helpers.experts import gate_and_up

E = 8


def _layer(**overrides) -> MoELayer:
    cfg = MoEConfig(**{"num_experts": E, "top_k": 2, "expert_dim": 6, **overrides})
    layer = MoELayer(cfg.num_experts, cfg)
    init_parameters(layer, 0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(cfg.num_experts))
    return layer


# ---- references ----------------------------------------------------------------------------------


def _softmax(values):
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def _ref_route(logits, cfg: MoEConfig, bias=None):
    """One token: (scores, gates, chosen experts) by the documented rules, in Python floats."""
    n = len(logits)
    if cfg.score_func == "softmax":
        scores = _softmax(logits)
    else:
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    key = list(logits if cfg.topk_before_softmax else scores)
    if bias is not None:
        key = [v + b for v, b in zip(key, bias)]
    allowed = list(range(n))
    if cfg.n_groups > 1:
        per = n // cfg.n_groups
        summed = cfg.group_score_experts or cfg.top_k // cfg.topk_groups
        strength = [sum(sorted(key[g * per:(g + 1) * per], reverse=True)[:summed])
                    for g in range(cfg.n_groups)]
        groups = sorted(range(cfg.n_groups), key=lambda g: (-strength[g], g))[: cfg.topk_groups]
        allowed = [e for e in range(n) if e // per in groups]
    chosen = sorted(allowed, key=lambda e: (-key[e], e))[: cfg.top_k]
    if cfg.topk_before_softmax:
        gates = _softmax([logits[e] for e in chosen])
    else:
        gates = [scores[e] for e in chosen]
        if cfg.norm_topk_prob:
            gates = [g / sum(gates) for g in gates]
    return scores, gates, chosen


def _ref_route_all(x_TE, cfg, bias=None):
    rows = [_ref_route(row, cfg, bias) for row in x_TE.double().tolist()]
    scores = torch.tensor([r[0] for r in rows], dtype=torch.float32).view(len(rows), cfg.num_experts)
    gates = torch.tensor([r[1] for r in rows], dtype=torch.float32).view(len(rows), cfg.top_k)
    chosen = torch.tensor([r[2] for r in rows], dtype=torch.long).view(len(rows), cfg.top_k)
    return scores, gates, chosen


def _ref_capacity(gates, scores, chosen, valid, capacity, policy):
    """Zero the gates of assignments past each expert's capacity, expert by expert."""
    gates = [list(row) for row in gates]
    for e in range(E):
        mine = [(t, k) for t in range(len(chosen)) for k in range(len(chosen[t])) if chosen[t][k] == e]
        if policy == "probs":
            mine.sort(key=lambda tk: (not valid[tk[0]], -scores[tk[0]][chosen[tk[0]][tk[1]]], tk))
        else:
            mine.sort(key=lambda tk: (not valid[tk[0]], tk))
        for t, k in mine[capacity:]:
            gates[t][k] = 0.0
    return torch.tensor(gates)


def _ref_switch(scores, chosen, valid, k):
    """E * sum_e f_e P_e over the valid tokens, with loops."""
    real = [t for t in range(len(chosen)) if valid[t]]
    if not real:
        return 0.0
    n_experts = len(scores[0])
    f = [sum(chosen[t].count(e) for t in real) / (len(real) * k) for e in range(n_experts)]
    P = [sum(scores[t][e] for t in real) / len(real) for e in range(n_experts)]
    return n_experts * sum(fe * pe for fe, pe in zip(f, P))


# ---- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(score_func="relu"), r"llm.moe.score_func \('relu'\) must be one of softmax, sigmoid"),
        (dict(aux_loss="global"), r"llm.moe.aux_loss \('global'\) must be one of micro_batch, seq, none"),
        (dict(drop_policy="random"), r"llm.moe.drop_policy \('random'\)"),
        (dict(z_loss_coef=-1.0), r"llm.moe.z_loss_coef \(-1.0\) must be >= 0"),
        (dict(expert_bias_rate=0.0), r"llm.moe.expert_bias_rate \(0.0\) must be > 0"),
        (dict(capacity_factor=0.0), r"llm.moe.capacity_factor \(0.0\) must be > 0"),
        (dict(score_func="sigmoid", topk_before_softmax=True), r"llm.moe.topk_before_softmax needs .*'sigmoid'"),
        (dict(n_groups=3), r"llm.moe.n_groups \(3\) must divide llm.moe.num_experts \(4\)"),
        (dict(n_groups=0), r"llm.moe.n_groups \(0\)"),
        (dict(n_groups=2, topk_groups=3), r"llm.moe.topk_groups \(3\) must be in \[1, llm.moe.n_groups \(2\)\]"),
        (dict(top_k=3, n_groups=2, topk_groups=2), r"llm.moe.topk_groups \(2\) must divide llm.moe.top_k \(3\)"),
        (dict(num_experts=8, top_k=4, n_groups=4), r"llm.moe.top_k / llm.moe.topk_groups \(4\) must be <= .* \(2\)"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kwargs)


# ---- selection -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(norm_topk_prob=False),
        dict(top_k=1),
        dict(top_k=E),
        dict(topk_before_softmax=True),
        dict(topk_before_softmax=True, norm_topk_prob=False),
        dict(score_func="sigmoid"),
        dict(score_func="sigmoid", norm_topk_prob=False),
        dict(n_groups=4, topk_groups=2),
        dict(n_groups=2, topk_groups=1, top_k=3),
        dict(score_func="sigmoid", n_groups=4, topk_groups=2, top_k=4),
        {"score_func": "sigmoid", "n_groups": 2, "topk_groups": 1, "top_k": 2, "group_score_experts": 3},
        {"score_func": "sigmoid", "n_groups": 4, "topk_groups": 2, "top_k": 3, "group_score_experts": 2},
    ],
)
def test_route_matches_reference(options):
    torch.manual_seed(0)
    layer = _layer(**options)
    x_TE = 2 * torch.randn(13, E)
    scores, gates, idx = layer.route(x_TE)
    ref_scores, ref_gates, ref_idx = _ref_route_all(x_TE, layer.cfg)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(scores, ref_scores)
    torch.testing.assert_close(gates, ref_gates)


def test_topk_before_softmax_differs_from_unnormalised_post_softmax():
    layer_pre = _layer(topk_before_softmax=True, norm_topk_prob=False)
    layer_post = _layer(norm_topk_prob=False)
    x_TE = torch.randn(5, E)
    _, gates_pre, idx_pre = layer_pre.route(x_TE)
    _, gates_post, idx_post = layer_post.route(x_TE)
    assert torch.equal(idx_pre, idx_post)
    torch.testing.assert_close(gates_pre.sum(-1), torch.ones(5))
    assert (gates_post.sum(-1) < 1).all()


def test_group_limited_selection_by_hand():
    # Groups {0,1} {2,3} {4,5} {6,7}; k=4 from 2 groups; a group's strength is the sum of its
    # top 4 / 2 = 2 logits' sigmoids: groups {2,3} and {6,7} win although 0 and 4 score highest.
    layer = _layer(n_groups=4, topk_groups=2, top_k=4, score_func="sigmoid")
    x = torch.tensor([[5.0, -5.0, 3.0, 3.0, 4.0, -5.0, 1.0, 1.0]])
    assert layer.route(x)[2].tolist() == [[2, 3, 6, 7]]
    assert _layer(top_k=4, score_func="sigmoid").route(x)[2].tolist() == [[0, 4, 2, 3]]
    # k=2 from 2 groups: by each group's top 2 / 2 = 1, groups {0,1} and {4,5}; by DeepSeek-V3's
    # top 2 whatever top_k / topk_groups, {2,3} and {6,7}.
    assert _layer(n_groups=4, topk_groups=2, top_k=2, score_func="sigmoid").route(x)[2].tolist() == [[0, 4]]
    deepseek = _layer(n_groups=4, topk_groups=2, top_k=2, score_func="sigmoid", group_score_experts=2)
    assert deepseek.route(x)[2].tolist() == [[2, 3]]
    # One group of k=2: group {2,3} beats group {0,1}.
    layer = _layer(n_groups=4, topk_groups=1, top_k=2)
    x = torch.tensor([[3.0, -5.0, 2.8, 2.8, 0.0, 0.0, 0.0, 0.0]])
    assert layer.route(x)[2].tolist() == [[2, 3]]


def test_bias_changes_selection_not_gates():
    for score_func in ("softmax", "sigmoid"):
        layer = _layer(expert_bias=True, score_func=score_func)
        x_TE = torch.randn(9, E)
        scores, gates, idx = layer.route(x_TE)
        with torch.no_grad():
            layer.expert_bias_E.copy_(torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 5.0]))
        biased_scores, biased_gates, biased_idx = layer.route(x_TE)
        assert (biased_idx == 7).any(dim=-1).all() and not torch.equal(idx, biased_idx)
        assert torch.equal(scores, biased_scores)
        bias = layer.expert_bias_E.tolist()
        _, ref_gates, ref_idx = _ref_route_all(x_TE, layer.cfg, bias)
        assert torch.equal(biased_idx, ref_idx)
        torch.testing.assert_close(biased_gates, ref_gates)
        chosen_scores = scores.gather(1, biased_idx)  # the unbiased scores of the chosen experts
        torch.testing.assert_close(biased_gates, chosen_scores / chosen_scores.sum(-1, keepdim=True))


def test_ties_go_to_the_lower_index():
    layer = _layer(top_k=3)
    scores, gates, idx = layer.route(torch.zeros(4, E))
    assert idx.tolist() == [[0, 1, 2]] * 4
    torch.testing.assert_close(gates, torch.full((4, 3), 1 / 3))
    x = torch.tensor([[0.0, 1, 0, 1, 0, 1, 0, 1]])
    assert _layer(top_k=3).route(x)[2].tolist() == [[1, 3, 5]]
    # Two equally strong groups: the lower one wins.
    assert _layer(n_groups=2, topk_groups=1, top_k=2).route(x)[2].tolist() == [[1, 3]]


# ---- capacity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_dropping_matches_reference(policy, factor):
    torch.manual_seed(1)
    layer = _layer(capacity_factor=factor, drop_policy=policy)
    T = 12
    x_TE = torch.randn(T, E)
    x_TE[:, 3] += 1.5  # crowd expert 3
    valid = [t not in (2, 7) for t in range(T)]
    _, gates, idx = layer.route(x_TE, torch.tensor(valid))
    ref_scores, ref_gates, ref_idx = _ref_route_all(x_TE, layer.cfg)
    capacity = math.ceil(factor * T * 2 / E)
    expected = _ref_capacity(ref_gates.tolist(), ref_scores.tolist(), ref_idx.tolist(), valid, capacity, policy)
    assert torch.equal(idx, ref_idx)  # dropped assignments keep their slot
    torch.testing.assert_close(gates, expected)
    kept_per_expert = torch.zeros(E).index_add_(0, idx[gates > 0], torch.ones(int((gates > 0).sum())))
    assert kept_per_expert.max() <= capacity
    if factor == 0.5:
        assert (gates == 0).any()


def test_position_policy_keeps_earliest_tokens_and_padding_goes_last():
    layer = _layer(top_k=1, capacity_factor=1.0, drop_policy="position")  # capacity ceil(8/8) = 1
    x_TE = torch.zeros(8, E)
    x_TE[:, 5] = torch.arange(1.0, 9.0)  # every token picks expert 5, later tokens more strongly
    _, gates, _ = layer.route(x_TE)
    assert gates[:, 0].nonzero().flatten().tolist() == [0]
    valid = torch.tensor([False, False, True, True, True, True, True, True])
    _, gates, _ = layer.route(x_TE, valid)
    assert gates[:, 0].nonzero().flatten().tolist() == [2]
    # "probs" ranks by router score, not by the renormalised gate (1 for every token at K = 1).
    layer = _layer(top_k=1, capacity_factor=1.0, drop_policy="probs")
    assert layer.route(x_TE)[1][:, 0].nonzero().flatten().tolist() == [7]


def test_no_capacity_equals_huge_capacity_and_dropped_outputs_vanish():
    torch.manual_seed(2)
    x_TD = torch.randn(10, E)
    dropless, huge, tight = _layer(), _layer(capacity_factor=1e6), _layer(capacity_factor=0.5)
    ys = []
    for layer in (dropless, huge, tight):
        x = x_TD.clone().requires_grad_()
        y, aux = layer(x)
        (y.square().sum() + aux).backward()
        ys.append((y, x.grad, layer.w2_EFD.grad))
    for a, b in zip(ys[0], ys[1]):
        assert torch.equal(a, b)
    _, gates, idx = tight.route(x_TD)
    dropped = gates == 0
    assert dropped.any()
    # A looped reference over the kept assignments only.
    w1_EDF, w3_EDF = gate_and_up(tight)
    with torch.no_grad():
        for t in range(10):
            y_D = torch.zeros(E)
            for k in range(2):
                if not dropped[t, k]:
                    e = int(idx[t, k])
                    h = torch.nn.functional.silu(x_TD[t] @ w1_EDF[e]) * (x_TD[t] @ w3_EDF[e])
                    y_D += gates[t, k] * (h @ tight.w2_EFD[e])
            torch.testing.assert_close(ys[2][0][t], y_D)
    # An assignment that is dropped gets no gradient: an expert all of whose assignments were
    # dropped has a zero weight gradient.
    layer = _layer(top_k=1, capacity_factor=1.0)
    x = torch.zeros(8, E)
    x[:, 4] = 1.0
    x[0, 4] = 2.0
    x[1:, 6] = 0.5  # tokens 1..7 pick 4 too (1 > 0.5), but only one token fits
    y, _ = layer(x)
    y.sum().backward()
    assert layer.route(x)[1][:, 0].nonzero().flatten().tolist() == [0]
    for w in layer.expert_weights():
        assert w.grad[4].any() and not w.grad[6].any()


# ---- aux losses ----------------------------------------------------------------------------------


def test_micro_batch_loss_excludes_padding():
    torch.manual_seed(3)
    layer = _layer(aux_loss_coef=1.0)
    x_TE = torch.randn(9, E)
    valid = [True] * 6 + [False] * 3
    _, aux = layer(x_TE, torch.tensor(valid))
    scores, _, chosen = _ref_route_all(x_TE, layer.cfg)
    expected = _ref_switch(scores.tolist(), chosen.tolist(), valid, 2)
    torch.testing.assert_close(aux, torch.tensor(expected, dtype=torch.float32))
    assert layer.last_expert_counts_E.sum() == 12
    _, aux_real_only = layer(x_TE[:6])
    torch.testing.assert_close(aux, aux_real_only)
    # Padding gets no gradient from the aux loss.
    x = x_TE.clone().requires_grad_()
    layer(x, torch.tensor(valid))[1].backward()
    assert x.grad[:6].any() and not x.grad[6:].any()


def test_seq_loss_hand_computed():
    # Two experts, top-1. Sequence 0: both tokens score [0.75, 0.25] -> E * 1 * 0.75 = 1.5.
    # Sequence 1: scores [0.75, 0.25], [0.25, 0.75] -> balanced, 1.0. Mean 1.25; micro_batch 1.125.
    layer = MoELayer(2, MoEConfig(num_experts=2, top_k=1, aux_loss="seq", aux_loss_coef=1.0))
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2))
    ln3 = math.log(3.0)
    x = torch.tensor([[ln3, 0.0], [ln3, 0.0], [ln3, 0.0], [0.0, ln3], [0.0, ln3]])
    seq_ids = torch.tensor([0, 0, 1, 1, 1])
    valid = torch.tensor([True, True, True, True, False])  # the padding would unbalance seq 1
    _, aux = layer(x, valid, seq_ids)
    torch.testing.assert_close(aux, torch.tensor(1.25))
    layer.cfg.aux_loss = "micro_batch"
    # f = [3/4, 1/4], P = [(3*0.75 + 0.25)/4, (3*0.25 + 0.75)/4] = [0.625, 0.375]
    torch.testing.assert_close(layer(x, valid)[1], torch.tensor(2 * (0.75 * 0.625 + 0.25 * 0.375)))
    # A sequence with no real token is left out of the mean.
    layer.cfg.aux_loss = "seq"
    _, aux = layer(x, torch.tensor([True, True, False, False, False]), seq_ids)
    torch.testing.assert_close(aux, torch.tensor(1.5))
    with pytest.raises(ValueError, match="needs seq_ids_T"):
        layer(x)


def test_sigmoid_balance_loss_uses_normalised_scores():
    layer = _layer(score_func="sigmoid", aux_loss_coef=1.0)
    x_TE = torch.randn(7, E)
    _, aux = layer(x_TE)
    scores, _, chosen = _ref_route_all(x_TE, layer.cfg)
    probs = [[s / sum(row) for s in row] for row in scores.tolist()]
    expected = _ref_switch(probs, chosen.tolist(), [True] * 7, 2)
    torch.testing.assert_close(aux, torch.tensor(expected, dtype=torch.float32))


def test_z_loss_and_coefficients():
    layer = _layer(aux_loss="none", z_loss_coef=1.0)
    x_TE = torch.randn(6, E)
    valid = [True, False, True, True, False, True]
    _, z = layer(x_TE, torch.tensor(valid))
    rows = x_TE.double().tolist()
    expected = sum(math.log(sum(math.exp(v) for v in rows[t])) ** 2 for t in range(6) if valid[t]) / 4
    torch.testing.assert_close(z, torch.tensor(expected, dtype=torch.float32))
    _, none = _layer(aux_loss="none")(x_TE)
    assert none.item() == 0.0
    _, balance = _layer(aux_loss_coef=1.0)(x_TE, torch.tensor(valid))
    _, both = _layer(aux_loss_coef=0.3, z_loss_coef=0.02)(x_TE, torch.tensor(valid))
    torch.testing.assert_close(both, 0.3 * balance + 0.02 * z)


def test_model_passes_padding_and_sums_scaled_layer_losses():
    cfg = LLMConfig(vocab_size=23, n_layers=3, dense_layers=(0,), moe=MoEConfig(aux_loss="seq", z_loss_coef=1e-3))
    model = MoELM(cfg)
    init_parameters(model, 0)
    ids = torch.randint(23, (2, 6))
    valid = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    other = ids.clone()
    other[1, 3:] = (ids[1, 3:] + 1) % 23  # different padding, right-aligned: real tokens unchanged
    _, aux = model(ids, valid_BS=valid)
    _, aux_other = model(other, valid_BS=valid)
    torch.testing.assert_close(aux, aux_other, rtol=0, atol=0)
    assert not torch.equal(model(ids)[1], model(other)[1])
    layer_losses = []
    hooks = [
        block.feed_forward.register_forward_hook(lambda m, i, out: layer_losses.append(out[1]))
        for block in model.layers[1:]
    ]
    _, aux = model(ids, valid_BS=valid)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(aux, layer_losses[0] + layer_losses[1])


# ---- expert bias ---------------------------------------------------------------------------------


def test_expert_bias_update_rule():
    layer = _layer(top_k=1, expert_bias=True, expert_bias_rate=0.1)
    assert "expert_bias_E" in layer.state_dict() and "expert_counts_E" not in layer.state_dict()
    x = torch.zeros(6, E)
    x[:4, 2] = 1.0  # 4 tokens to expert 2, 2 to expert 0 (ties)
    layer(x)
    layer(x[:3], torch.tensor([True, False, True]))  # padding not counted
    with torch.no_grad():
        layer(x)  # no gradient: an evaluation pass, not counted
    layer.eval()
    layer(x)
    layer.train()
    assert layer.expert_counts_E.tolist() == [2, 0, 6, 0, 0, 0, 0, 0]
    update_expert_biases(torch.nn.Sequential(layer))
    # mean 1: below-mean experts go up, above-mean go down, by the rate.
    torch.testing.assert_close(layer.expert_bias_E, torch.tensor([-0.1, 0.1, -0.1, 0.1, 0.1, 0.1, 0.1, 0.1]))
    assert not layer.expert_counts_E.any()
    update_expert_biases(torch.nn.Sequential(layer))  # no new counts: nothing changes
    torch.testing.assert_close(layer.expert_bias_E, torch.tensor([-0.1, 0.1, -0.1, 0.1, 0.1, 0.1, 0.1, 0.1]))
    assert layer.expert_bias_E.dtype == torch.float32
    plain = _layer()
    update_expert_biases(torch.nn.Sequential(plain))  # a no-op when the option is off
    assert plain.expert_bias_E is None and "expert_bias_E" not in plain.state_dict()


# ---- precision and empty inputs ------------------------------------------------------------------


ALL_OPTIONS = [
    dict(score_func="sigmoid", n_groups=4, topk_groups=2, expert_bias=True, z_loss_coef=1e-3),
    dict(topk_before_softmax=True, capacity_factor=1.0, drop_policy="position", aux_loss="seq"),
    dict(capacity_factor=0.75, z_loss_coef=1e-2, expert_bias=True),
]


@pytest.mark.parametrize("options", ALL_OPTIONS)
def test_router_stays_float32_under_bf16_autocast(options):
    layer = _layer(**options)
    x_TE = torch.randn(10, E)
    seq_ids = torch.tensor([0] * 5 + [1] * 5)
    expected = layer.route(x_TE)
    _, aux_expected = layer(x_TE, None, seq_ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer.route(x_TE)
        y, aux = layer(x_TE, None, seq_ids)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert got[0].dtype == got[1].dtype == aux.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(aux, aux_expected)


@pytest.mark.parametrize("options", ALL_OPTIONS + [dict()])
def test_zero_tokens(options):
    layer = _layer(**options)
    x = torch.zeros(0, E, requires_grad=True)
    y, aux = layer(x, torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long))
    assert y.shape == (0, E) and aux.item() == 0.0
    (y.sum() + aux).backward()
    update_expert_biases(layer)


# ---- distributed statistics ----------------------------------------------------------------------

DIST_OPTIONS = [
    dict(aux_loss_coef=1.0, z_loss_coef=0.1),
    dict(aux_loss_coef=1.0, aux_loss="seq", score_func="sigmoid", z_loss_coef=0.1),
]
# Tokens of one microbatch of three sequences, dealt to the ranks unevenly; the last rank has none.
SHARDS = [[0, 3, 4, 9, 10, 12], [1, 2, 5, 6, 7, 8, 11], []]
SEQ_IDS = [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]
VALID = [True, True, True, False, True, True, True, True, False, True, True, True, False]


def _single_process_expectations(x_TE):
    expected = []
    for options in DIST_OPTIONS:
        layer = _layer(**options)
        x = x_TE.clone().requires_grad_()
        _, aux = layer(x, torch.tensor(VALID), torch.tensor(SEQ_IDS))
        aux.backward()
        expected.append((aux.detach(), x.grad, layer.router.weight.grad))
    return expected


def _stats_and_counts_body(rank, world_size, x_TE, expected, bias_expected):
    mine = torch.tensor(SHARDS[rank], dtype=torch.long)
    for options, (aux_expected, x_grad_expected, router_grad_expected) in zip(DIST_OPTIONS, expected):
        layer = _layer(**options)
        layer.stats_group = dist.group.WORLD
        x = x_TE[mine].clone().requires_grad_()
        _, aux = layer(x, torch.tensor(VALID)[mine], torch.tensor(SEQ_IDS)[mine])
        torch.testing.assert_close(aux, aux_expected)  # every rank: the whole microbatch's loss
        # Each rank contributes 1 / world of it (the parallelize step's scaling): the parts sum to
        # the loss, and each rank's input gradient is the single-process one.
        (aux / world_size).backward()
        torch.testing.assert_close(x.grad, x_grad_expected[mine])
        router_grad = layer.router.weight.grad.clone()
        dist.all_reduce(router_grad)
        torch.testing.assert_close(router_grad, router_grad_expected)

    pair = dist.new_group([0, 1])  # every rank creates it; the empty rank is not in it
    if rank < 2:
        layer = _layer(expert_bias=True, expert_bias_rate=0.5)
        layer(x_TE[mine], torch.tensor(VALID)[mine])
        update_expert_biases(layer, pair)
        torch.testing.assert_close(layer.expert_bias_E, bias_expected)
        assert not layer.expert_counts_E.any()


def test_distributed_statistics_match_single_process():
    torch.manual_seed(4)
    x_TE = torch.randn(13, E)
    expected = _single_process_expectations(x_TE)
    _, _, chosen = _ref_route_all(x_TE, _layer().cfg)
    counts = [sum(row.count(e) for row, v in zip(chosen.tolist(), VALID) if v) for e in range(E)]
    mean = sum(counts) / E
    bias_expected = torch.tensor([0.5 * ((mean > c) - (mean < c)) for c in counts])
    assert bias_expected.abs().sum() > 0
    run_distributed(_stats_and_counts_body, 3, x_TE, expected, bias_expected)
