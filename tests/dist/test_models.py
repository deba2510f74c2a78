"""Encoder, MoE layer, LLM and parameter-init tests (CPU, float32, tiny configs)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dyad.encoder_service.config import EncoderConfig
from dyad.encoder_service.model import VisionEncoder
from dyad.init import init_parameters
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.llm_service.model import MoELM, caption_loss_sum, greedy_next_token
from dyad.llm_service.moe import MoELayer, SwiGLU
from tests.helpers.distributed import run_distributed
from tests.helpers.experts import gate_and_up

V = 37


def _llm(seed: int = 0, **overrides) -> MoELM:
    cfg = LLMConfig(vocab_size=V, **overrides)
    model = MoELM(cfg)
    init_parameters(model, seed)
    return model


def _moe(dim: int = 8, seed: int = 0, **overrides) -> MoELayer:
    layer = MoELayer(dim, MoEConfig(**overrides))
    init_parameters(layer, seed)
    with torch.no_grad():  # 0.02-scale routers give near-uniform scores; spread them out
        layer.router.weight.mul_(50.0)
    return layer


# ---- config validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(patch_size=17), r"encoder.patch_size \(17\) must be <= encoder.image_size \(16\)"),
        (dict(heads=3), r"encoder.heads \(3\) must divide encoder.dim \(64\)"),
        (dict(depth=0), r"encoder.depth \(0\) must be >= 1"),
        (dict(out_dim=-1), r"encoder.out_dim \(-1\)"),
        (dict(mlp_ratio=0.0), r"encoder.mlp_ratio \(0.0\)"),
        (dict(spatial_merge=0), r"encoder.spatial_merge \(0\) must be >= 1"),
        (dict(spatial_merge=3), r"encoder.spatial_merge \(3\) must divide the patch grid side \(4 = "),
    ],
)
def test_encoder_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EncoderConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_kv_heads=3), r"llm.n_kv_heads \(3\) must divide llm.n_heads \(4\)"),
        (dict(n_heads=5), r"llm.n_heads \(5\) must divide llm.dim \(64\)"),
        (dict(dim=24, n_heads=8, n_kv_heads=2), r"must be even for rotary"),
        (dict(dense_layers=(2,)), r"llm.dense_layers entry \(2\) must be in \[0, llm.n_layers \(2\)\)"),
        (dict(n_layers=0), r"llm.n_layers \(0\) must be >= 1"),
    ],
)
def test_llm_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLMConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=5), r"llm.moe.top_k \(5\) must be in \[1, llm.moe.num_experts \(4\)\]"),
        (dict(top_k=0), r"llm.moe.top_k \(0\)"),
        (dict(num_experts=0, top_k=1), r"llm.moe.num_experts \(0\) must be >= 1"),
        (dict(shared_expert_dim=-1), r"llm.moe.shared_expert_dim \(-1\)"),
    ],
)
def test_moe_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kwargs)


def test_llm_needs_vocab_size_at_build_time():
    cfg = LLMConfig()
    with pytest.raises(ValueError, match=r"llm.vocab_size \(0\) must be > 0"):
        MoELM(cfg)


# ---- vision encoder ----------------------------------------------------------------------------


def test_encoder_shapes_and_empty_batch():
    cfg = EncoderConfig(channels=3, out_dim=48)
    encoder = VisionEncoder(cfg)
    init_parameters(encoder, 0)
    assert cfg.tokens_per_image == 16
    assert encoder(torch.randn(2, 3, 16, 16)).shape == (2, 16, 48)
    empty = encoder(torch.randn(0, 3, 16, 16))
    assert empty.shape == (0, 16, 48) and empty.requires_grad
    empty.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in encoder.parameters())


def test_encoder_patch_embedding_equals_strided_conv():
    cfg = EncoderConfig(channels=2, patch_size=4)
    encoder = VisionEncoder(cfg)
    images = torch.randn(3, 2, 16, 16)
    weight = encoder.patch_embed.weight.view(cfg.dim, 2, 4, 4)
    conv_NDhw = F.conv2d(images, weight, encoder.patch_embed.bias, stride=4)
    expected = conv_NDhw.flatten(2).transpose(1, 2)
    torch.testing.assert_close(encoder.patch_embed(encoder.patchify(images)), expected)


def test_spatial_merge_concatenates_each_square_of_patches():
    cfg = EncoderConfig(image_size=24, patch_size=4, spatial_merge=2, out_dim=48)  # a 6 x 6 patch grid
    encoder = VisionEncoder(cfg)
    assert (cfg.patches_per_image, cfg.tokens_per_image, cfg.merged_dim) == (36, 9, 256)
    x_NPD = torch.randn(2, 36, cfg.dim)
    merged = encoder.merge_patches(x_NPD)
    for row in range(3):
        for col in range(3):
            square = [x_NPD[:, (2 * row + dr) * 6 + 2 * col + dc] for dr in (0, 1) for dc in (0, 1)]
            torch.testing.assert_close(merged[:, row * 3 + col], torch.cat(square, dim=-1), rtol=0, atol=0)
    init_parameters(encoder, 0)
    assert encoder(torch.randn(2, 1, 24, 24)).shape == (2, 9, 48)


def test_encoder_rejects_wrong_image_shape():
    with pytest.raises(ValueError, match=r"images must have shape \[N, 1, 16, 16\], got \[2, 1, 8, 8\]"):
        VisionEncoder(EncoderConfig())(torch.randn(2, 1, 8, 8))


# ---- MoE layer ---------------------------------------------------------------------------------


def _looped_moe(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token: route, run each chosen expert densely, add gated outputs."""
    cfg = layer.cfg
    w1_EDF, w3_EDF = gate_and_up(layer)
    outputs = []
    for x_D in x_TD:
        scores_E = torch.softmax(layer.router.weight @ x_D, dim=-1)
        gates_K, idx_K = torch.topk(scores_E, cfg.top_k)
        if cfg.norm_topk_prob:
            gates_K = gates_K / gates_K.sum()
        y_D = torch.zeros_like(x_D)
        for gate, e in zip(gates_K, idx_K.tolist()):
            h_F = F.silu(x_D @ w1_EDF[e]) * (x_D @ w3_EDF[e])
            y_D = y_D + gate * (h_F @ layer.w2_EFD[e])
        if layer.shared_expert is not None:
            y_D = y_D + layer.shared_expert(x_D)
        outputs.append(y_D)
    return torch.stack(outputs)


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(top_k=1), dict(top_k=4), dict(norm_topk_prob=False), dict(shared_expert_dim=12)],
)
def test_moe_grouped_matches_looped_experts(overrides):
    torch.manual_seed(0)
    layer = _moe(dim=8, expert_dim=16, **overrides)
    x_TD = torch.randn(11, 8, requires_grad=True)
    y_TD, _ = layer(x_TD)
    x_ref = x_TD.detach().clone().requires_grad_()
    y_ref = _looped_moe(layer, x_ref)
    torch.testing.assert_close(y_TD, y_ref)
    g = torch.randn_like(y_TD)
    torch.autograd.backward(y_TD, g)
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    torch.autograd.backward(y_ref, g)
    torch.testing.assert_close(x_TD.grad, x_ref.grad)
    for grad, p in zip(grads, layer.parameters()):
        torch.testing.assert_close(grad, p.grad)


def test_single_expert_top1_equals_dense_swiglu():
    layer = _moe(dim=8, num_experts=1, top_k=1, expert_dim=16)
    dense = SwiGLU(8, 16)
    with torch.no_grad():
        w1_EDF, w3_EDF = gate_and_up(layer)
        dense.w1.weight.copy_(w1_EDF[0].T)
        dense.w3.weight.copy_(w3_EDF[0].T)
        dense.w2.weight.copy_(layer.w2_EFD[0].T)
    x_TD = torch.randn(9, 8)
    y_TD, aux = layer(x_TD)
    torch.testing.assert_close(y_TD, dense(x_TD))
    torch.testing.assert_close(aux, torch.tensor(layer.cfg.aux_loss_coef * 1.0))  # aux comes scaled by its coef
    assert layer.last_expert_counts_E.tolist() == [9]


def test_moe_aux_loss_hand_computed():
    layer = MoELayer(2, MoEConfig(num_experts=2, top_k=1, aux_loss_coef=1.0))  # aux comes scaled by its coef
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2))
    ln3 = torch.log(torch.tensor(3.0)).item()
    # Both tokens score [0.75, 0.25] and pick expert 0: f = [1, 0], P = [0.75, 0.25].
    _, aux = layer(torch.tensor([[ln3, 0.0], [ln3, 0.0]]))
    torch.testing.assert_close(aux, torch.tensor(2 * 0.75))
    # Scores [0.75, 0.25] and [0.25, 0.75]: f = P = [0.5, 0.5], the balanced value 1.
    _, aux = layer(torch.tensor([[ln3, 0.0], [0.0, ln3]]))
    torch.testing.assert_close(aux, torch.tensor(1.0))
    assert layer.last_expert_counts_E.tolist() == [1, 1]


def test_moe_aux_loss_top2_hand_computed():
    layer = MoELayer(3, MoEConfig(num_experts=3, top_k=2, aux_loss_coef=1.0))
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(3))
    x_TD = torch.log(torch.tensor([[4.0, 3.0, 1.0], [1.0, 3.0, 4.0]]))  # scores x / 8
    _, aux = layer(x_TD)
    f = torch.tensor([1, 2, 1]) / 4
    P = torch.tensor([5.0, 6.0, 5.0]) / 16
    torch.testing.assert_close(aux, 3 * (f * P).sum())
    assert layer.last_expert_counts_E.tolist() == [1, 2, 1]


def test_moe_with_idle_experts_and_no_tokens():
    layer = _moe(dim=8, num_experts=4, top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 10.0  # every token with x[0] > 0 goes to expert 2
    x_TD = torch.randn(6, 8).abs().requires_grad_()
    y_TD, aux = layer(x_TD)
    assert layer.last_expert_counts_E.tolist() == [0, 0, 6, 0]
    (y_TD.sum() + aux).backward()
    for w in layer.expert_weights():
        assert not w.grad[[0, 1, 3]].any() and w.grad[2].any()

    empty = torch.zeros(0, 8, requires_grad=True)
    y_TD, aux = layer(empty)
    assert y_TD.shape == (0, 8) and aux.item() == 0.0
    (y_TD.sum() + aux).backward()
    assert layer.last_expert_counts_E.tolist() == [0, 0, 0, 0]


# ---- language model ----------------------------------------------------------------------------


def test_llm_shapes_and_aux_loss():
    model = _llm(n_layers=3, dense_layers=(0,))
    ids = torch.randint(V, (2, 7))
    logits, aux = model(ids)
    assert logits.shape == (2, 7, V) and aux.shape == () and aux.item() > 0
    layer_sum = sum(moe_aux for moe_aux in _moe_aux_losses(model, ids))  # each scaled by aux_loss_coef
    torch.testing.assert_close(aux, layer_sum)

    dense_only = _llm(dense_layers=(0, 1))
    logits, aux = dense_only(ids)
    assert aux.shape == () and aux.item() == 0.0

    logits, aux = model(torch.zeros(0, 7, dtype=torch.long))  # an empty batch
    assert logits.shape == (0, 7, V) and aux.item() == 0.0
    (logits.sum() + aux).backward()


def _moe_aux_losses(model, ids):
    losses = []
    hooks = [
        layer.feed_forward.register_forward_hook(lambda m, inp, out: losses.append(out[1].detach()))
        for layer in model.layers
        if layer.is_moe
    ]
    model(ids)
    for hook in hooks:
        hook.remove()
    assert len(losses) == 2
    return losses


def test_llm_is_causal():
    model = _llm()
    ids = torch.randint(V, (2, 10))
    changed = ids.clone()
    changed[:, 6] = (ids[:, 6] + 1) % V
    logits, _ = model(ids)
    logits_changed, _ = model(changed)
    torch.testing.assert_close(logits[:, :6], logits_changed[:, :6])
    assert not torch.allclose(logits[:, 6:], logits_changed[:, 6:])


def test_llm_rejects_too_long_sequences():
    with pytest.raises(ValueError, match=r"sequence length \(9\) exceeds llm.max_seq_len \(8\)"):
        _llm(max_seq_len=8)(torch.zeros(1, 9, dtype=torch.long))


def test_splice_places_image_embeds_exactly():
    model = _llm()
    B, S, D = 2, 8, model.cfg.dim
    ids = torch.randint(V, (B, S))
    positions = torch.tensor([1, 2, 3, 9, 10])
    embeds = torch.randn(5, D)
    captured = []
    model.layers[0].register_forward_pre_hook(lambda m, args: captured.append(args[0].detach()))
    model(ids, embeds, positions)
    h_TD = captured[0].reshape(B * S, D)
    expected = model.tok_embeddings.weight.detach()[ids.reshape(-1)].clone()
    expected[positions] = embeds
    torch.testing.assert_close(h_TD, expected, rtol=0, atol=0)


def test_splice_matches_patched_embedding_table_with_gradients():
    model = _llm()
    B, S, D = 2, 8, model.cfg.dim
    ids = torch.randint(V, (B, S))
    positions = torch.tensor([0, 1, 8, 9, 10])
    embeds = torch.randn(5, D, requires_grad=True)
    targets = torch.randint(V, (B, S))

    logits, _ = model(ids, embeds, positions)
    caption_loss_sum(logits, targets).backward()

    # Same model whose table has one extra row per image token, looked up by new ids.
    patched = copy.deepcopy(model)
    table = torch.cat([model.tok_embeddings.weight.detach(), embeds.detach()])
    patched.tok_embeddings = nn.Embedding.from_pretrained(table, freeze=False)
    patched_ids = ids.clone().reshape(-1)
    patched_ids[positions] = V + torch.arange(5)
    patched_logits, _ = patched(patched_ids.view(B, S))
    caption_loss_sum(patched_logits, targets).backward()

    torch.testing.assert_close(logits, patched_logits)
    torch.testing.assert_close(embeds.grad, patched.tok_embeddings.weight.grad[V:])
    assert embeds.grad.abs().sum() > 0


def test_no_images_splice_is_identity():
    model = _llm()
    ids = torch.randint(V, (2, 6))
    embeds = torch.zeros(0, model.cfg.dim, requires_grad=True)
    logits, _ = model(ids, embeds, torch.zeros(0, dtype=torch.long))
    torch.testing.assert_close(logits, model(ids)[0])
    logits.sum().backward()
    assert embeds.grad.shape == (0, model.cfg.dim)
    with pytest.raises(ValueError, match="must be given together"):
        model(ids, embeds, None)


def test_caption_loss_sum_and_greedy_next_token():
    model = _llm()
    ids = torch.randint(V, (3, 6))
    targets = torch.randint(V, (3, 6))
    targets[0, 4:] = -100
    targets[2, :] = -100
    logits, _ = model(ids)
    loss = caption_loss_sum(logits, targets)
    keep = targets != -100
    expected = -torch.log_softmax(logits, -1)[keep].gather(1, targets[keep].unsqueeze(1)).sum()
    torch.testing.assert_close(loss, expected)
    assert loss.dtype == torch.float32
    assert caption_loss_sum(logits, torch.full_like(targets, -100)).item() == 0.0

    lengths = torch.tensor([6, 2, 4])
    next_token = greedy_next_token(model, ids, None, None, lengths)
    assert next_token.tolist() == [logits[b, n - 1].argmax().item() for b, n in enumerate(lengths.tolist())]


# ---- parameter init ----------------------------------------------------------------------------


class _AB(nn.Module):
    def __init__(self, a_first: bool):
        super().__init__()
        if a_first:
            self.a = nn.Linear(6, 5)
            self.b = nn.LayerNorm(5)
        else:
            self.b = nn.LayerNorm(5)
            self.a = nn.Linear(6, 5)


def test_init_independent_of_construction_and_device_state():
    torch.manual_seed(1)
    first = _AB(a_first=True)
    torch.manual_seed(2)
    second = _AB(a_first=False).to(torch.bfloat16)
    init_parameters(first, seed=7)
    init_parameters(second, seed=7)
    for name, p in first.named_parameters():
        torch.testing.assert_close(p.to(torch.bfloat16), second.get_parameter(name))
    assert (first.b.weight == 1).all() and not first.b.bias.any() and not first.a.bias.any()
    other = _AB(a_first=True)
    init_parameters(other, seed=8)
    assert not torch.equal(first.a.weight, other.a.weight)
    assert torch.equal(first.b.weight, other.b.weight)


def test_init_same_values_on_one_thread_and_many():
    one, many = _llm(seed=3), _llm(seed=3)
    init_parameters(one, seed=5, threads=1)
    init_parameters(many, seed=5, threads=4)
    for name, p in one.named_parameters():
        assert torch.equal(p, many.get_parameter(name)), name


def test_init_error_in_a_thread_reaches_the_caller(monkeypatch):
    import dyad.init

    def broken(name, *args):
        raise RuntimeError(f"cannot draw {name}")

    monkeypatch.setattr(dyad.init, "initial_value", broken)
    with pytest.raises(RuntimeError, match="cannot draw"):
        init_parameters(_AB(a_first=True), seed=0, threads=2)


def test_init_llm_and_encoder_by_name():
    torch.manual_seed(0)
    a = _llm(seed=3)
    torch.manual_seed(1)
    b = _llm(seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert (a.layers[1].ffn_norm.weight == 1).all() and (a.norm.weight == 1).all()
    w = a.layers[1].feed_forward.w13_ED2F
    assert abs(w.std().item() - 0.02) < 0.002
    assert not torch.equal(a.output.weight, a.tok_embeddings.weight)  # same shape, other name

    encoder = VisionEncoder(EncoderConfig())
    init_parameters(encoder, 3)
    assert (encoder.blocks[0].attn_norm.weight == 1).all() and not encoder.blocks[0].proj.bias.any()
    assert encoder.blocks[0].qkv.bias is None  # a key bias cannot change attention


def _init_sharded_worker(rank: int, world: int, expected: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = _AB(a_first=False)
    for module in (model.a, model.b):
        for name, p in list(module.named_parameters()):
            sharded = distribute_tensor(torch.randn(p.shape), mesh, [Shard(0)])
            setattr(module, name, nn.Parameter(sharded))
    init_parameters(model, seed=7)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), expected[name])


def test_init_sharded_parameters_get_their_slice_of_the_full_tensor():
    reference = _AB(a_first=True)
    init_parameters(reference, seed=7)
    expected = {name: p.detach().clone() for name, p in reference.named_parameters()}
    run_distributed(_init_sharded_worker, 2, expected)


def test_moe_routes_in_float32_under_autocast():
    layer = _moe(dim=8, expert_dim=16)
    x_TD = torch.randn(12, 8)
    scores, gates, idx = layer.route(x_TD)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores_ac, gates_ac, idx_ac = layer.route(x_TD)
        y_TD, aux = layer(x_TD)
    assert scores_ac.dtype == gates_ac.dtype == aux.dtype == torch.float32
    assert torch.equal(scores, scores_ac) and torch.equal(gates, gates_ac) and torch.equal(idx, idx_ac)
    assert y_TD.dtype == torch.bfloat16
    torch.testing.assert_close(y_TD.float(), layer(x_TD)[0], atol=2e-2, rtol=2e-2)
