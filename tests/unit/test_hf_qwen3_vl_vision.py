"""Qwen3-VL's native-resolution vision tower (dyad/encoder_service/qwen3_vl.py) against
transformers' (`Qwen3VLMoeVisionModel`, and Qwen3-VL's, the same code): a tiny random tower built
and saved with transformers, loaded by dyad, a batch of images of different patch grids through
both: the last hidden state, the merged tokens, every DeepStack feature and every parameter's
gradient equal (float32: 1e-5 relative, max norm). The position embedding's resampling and the
2-D rotary equal transformers' bit for bit; images of one batch never see each other; the
export inverse gives back the checkpoint's tensors; a config dyad does not model is refused
naming the field."""

from __future__ import annotations

import json

import pytest
import torch

import dyad.hf
from dyad.encoder_service.config import Qwen3VLVisionConfig
from dyad.encoder_service.hf import qwen3_vl_state_dict, qwen3_vl_tower_tensors
from dyad.encoder_service.hf_config import qwen3_vl_vision_config
from dyad.encoder_service.qwen3_vl import bilinear_taps, patch_grid, rotary_cos_sin
from dyad.hf_checkpoint import HFCheckpoint
from dyad.kernels import varlen_attention as varlen
from tests.helpers.hf_models import make_norms_and_biases_matter
from tests.helpers.parity import relative_error

transformers = pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e '.[test]')")
from transformers.models.qwen3_vl import modeling_qwen3_vl
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

VISION = dict(depth=3, hidden_size=32, intermediate_size=56, num_heads=2, in_channels=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[0, 1],
              num_position_embeddings=16, out_hidden_size=48)
TOWERS = {
    "qwen3_vl_moe": (transformers.Qwen3VLMoeVisionConfig, modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel),
    "qwen3_vl": (transformers.Qwen3VLVisionConfig, modeling_qwen3_vl.Qwen3VLVisionModel),
}
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 6, 4), (2, 2, 4)]  # (frames, rows, columns) of patches; the last a 2-frame clip
X = 3 * 2 * 4 * 4  # a flattened patch: channels * temporal * patch * patch


def _saved(path, family="qwen3_vl_moe"):
    config, model = TOWERS[family]
    torch.manual_seed(0)
    tower = model(config(**VISION)).float().eval()
    make_norms_and_biases_matter(tower, bias_std=0.2)
    with torch.no_grad():  # transformers starts it at N(0, 0.02²): resampling errors would hide there
        tower.pos_embed.weight.normal_()
    tower.save_pretrained(path)
    return tower


def _inputs(grids=GRIDS, seed=1):
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(1).sum()), X, generator=torch.Generator().manual_seed(seed))
    return pixels, grid_thw


def _outputs(out) -> dict[str, torch.Tensor]:
    features = {f"deepstack {i}": x for i, x in enumerate(out.deepstack_features)}
    return {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output} | features


@pytest.mark.parametrize("family", TOWERS)
def test_outputs_and_gradients_match_transformers(family, tmp_path):
    reference = _saved(tmp_path, family)
    ours = dyad.hf.load(tmp_path)
    assert isinstance(ours, dyad.hf.Qwen3VLVisionTower)
    pixels, grid_thw = _inputs()
    expected, got = _outputs(reference(pixels, grid_thw=grid_thw)), _outputs(ours(pixels, grid_thw))
    assert got.keys() == expected.keys() and len(got) == 4
    upstream = {name: torch.randn(x.shape, generator=torch.Generator().manual_seed(i))
                for i, (name, x) in enumerate(expected.items())}
    for name, value in expected.items():
        assert got[name].shape == value.shape
        error = relative_error(got[name].detach(), value.detach(), "max")
        assert error <= 1e-5, f"{name}: relative error {error:.2e} (max norm)"

    sum(((x * upstream[name]).sum() for name, x in expected.items())).backward()
    sum(((x * upstream[name]).sum() for name, x in got.items())).backward()
    with torch.no_grad():  # transformers' gradients as a checkpoint of its names, read under dyad's
        for p in reference.parameters():
            p.copy_(p.grad)
    reference.save_pretrained(tmp_path / "grads")
    grads = qwen3_vl_state_dict(HFCheckpoint(tmp_path / "grads"), ours.model.cfg)
    named = dict(ours.model.named_parameters())
    assert grads.keys() == named.keys()
    for name, expected_grad in grads.items():
        error = relative_error(named[name].grad, expected_grad, "max")
        assert error <= 1e-5, f"{name}: relative error {error:.2e} (max norm)"


def test_the_tower_of_a_whole_model_is_transformers_visual_and_exports_to_its_names(tmp_path):
    text = dict(vocab_size=64, hidden_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=24, intermediate_size=32, moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]})
    torch.manual_seed(0)
    whole = transformers.Qwen3VLMoeForConditionalGeneration(
        transformers.Qwen3VLMoeConfig(vision_config=VISION, text_config=text)).float().eval()
    make_norms_and_biases_matter(whole, bias_std=0.2)
    whole.save_pretrained(tmp_path)
    ours = dyad.hf.load_qwen3_vl_vision(tmp_path)
    pixels, grid_thw = _inputs()
    with torch.no_grad():
        expected, got = _outputs(whole.model.visual(pixels, grid_thw=grid_thw)), _outputs(ours(pixels, grid_thw))
    for name, value in expected.items():
        assert relative_error(got[name], value, "max") <= 1e-5, name

    exported = qwen3_vl_tower_tensors(ours.model.state_dict(), ours.model.cfg, "model.visual.")
    saved = {name: p for name, p in whole.state_dict().items() if name.startswith("model.visual.")}
    assert exported.keys() == saved.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, saved[name]), name


def test_position_embedding_resampling_and_rotary_are_transformers_bit_for_bit():
    from transformers import vision_utils

    grid_thw = torch.tensor(GRIDS + [(1, 2, 2), (1, 2, 14)])
    grid = patch_grid(grid_thw, 2)
    taps, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=5, mode="bilinear", align_corners=True, spatial_merge_size=2)
    ours_taps, ours_weights = bilinear_taps(grid, 5)
    assert torch.equal(ours_taps, taps) and torch.equal(ours_weights, weights)

    config = transformers.Qwen3VLMoeVisionConfig(**VISION | {"hidden_size": 64, "num_heads": 2})
    rotary = modeling_qwen3_vl_moe.Qwen3VLMoeVisionRotaryEmbedding(config)
    positions = vision_utils.get_vision_position_ids(grid_thw, 2)
    cos, sin = rotary(torch.zeros(1), positions)
    ours_cos, ours_sin = rotary_cos_sin(grid, head_dim=32, theta=10000.0)
    assert torch.equal(ours_cos, cos) and torch.equal(ours_sin, sin)


def test_each_image_attends_only_to_itself(tmp_path):
    """A batch's tokens are each image's tokens as it alone gives them; changing one image's
    pixels changes its tokens and no other image's."""
    _saved(tmp_path)
    ours = dyad.hf.load(tmp_path)
    pixels, grid_thw = _inputs()
    patches = grid_thw.prod(1).tolist()
    tokens = [n // 4 for n in patches]
    with torch.no_grad():
        batch = ours(pixels, grid_thw)
        alone = [ours(image, grid_thw[i : i + 1]) for i, image in enumerate(pixels.split(patches))]
        changed = pixels.clone()
        changed[patches[0] : patches[0] + patches[1]] += 1.0  # the second image
        after = ours(changed, grid_thw)
    for name in ("pooler_output", "deepstack 0", "deepstack 1"):
        per_image = torch.cat([_outputs(out)[name] for out in alone])
        torch.testing.assert_close(_outputs(batch)[name], per_image, rtol=1e-6, atol=1e-6)
        before_rows, after_rows = _outputs(batch)[name].split(tokens), _outputs(after)[name].split(tokens)
        for i, (b, a) in enumerate(zip(before_rows, after_rows, strict=True)):
            assert torch.equal(a, b) != (i == 1), f"{name} of image {i}"


@pytest.mark.skipif(not torch.cuda.is_available() or varlen.varlen_attn is None,
                    reason="no CUDA device (or a torch without varlen_attn) here: the flash path is not exercised")
def test_flash_varlen_attention_matches_the_reference():
    lengths = [24, 64, 24, 8, 8]
    q, k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    upstream = torch.randn_like(q)
    results = []
    bounds = varlen.segment_bounds(lengths, "cuda")
    for attend in (lambda q, k, v: varlen.varlen_attention(q, k, v, *bounds, scale=0.125),
                   lambda q, k, v: varlen.varlen_attention_reference(q, k, v, lengths, scale=0.125)):
        out = attend(q, k, v)
        grads = torch.autograd.grad((out.float() * upstream).sum(), (q, k, v))
        results.append((out, *grads))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_inputs_that_do_not_fit_the_grid_are_refused(tmp_path):
    _saved(tmp_path)
    ours = dyad.hf.load(tmp_path)
    pixels, grid_thw = _inputs()
    with pytest.raises(ValueError, match=r"pixel_values must have shape \[128, 96\] .*got \[127, 96\]"):
        ours(pixels[1:], grid_thw)
    with pytest.raises(ValueError, match="multiples of encoder.spatial_merge .2., got .*\\[1, 3, 6\\]"):
        ours(pixels, torch.tensor([[1, 3, 6]]))


@pytest.mark.parametrize("field, value, message", [
    ("heads", 3, r"encoder.heads \(3\) must divide encoder.dim \(64\)"),
    ("heads", 32, r"encoder.heads \(32\) must divide encoder.dim \(64\) into heads of a multiple of 4"),
    ("deepstack_layers", (1, 0), r"encoder.deepstack_layers \(\[1, 0\]\) must be increasing"),
    ("deepstack_layers", (2,), r"encoder.deepstack_layers \(\[2\]\) must be increasing block indices in \[0, 2\)"),
    ("position_grid", 0, r"encoder.position_grid \(0\) must be >= 1"),
    ("activation", "relu", r"encoder.activation \('relu'\) must be one of"),
])
def test_a_config_error_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        Qwen3VLVisionConfig(**{field: value})


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "silu", "vision_config hidden_act='silu' is not supported"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1.0}, "vision_config rope_parameters=.* not supported"),
    ("num_position_embeddings", 15, "vision_config num_position_embeddings=15 must be a square"),
    ("patch_size", [4, 4], r"vision_config patch_size=\[4, 4\]: dyad takes one int"),
    ("deepstack_visual_indexes", [0, 3], r"deepstack_visual_indexes=\[0, 3\] must be increasing block indices in \[0, 3\)"),
])
def test_a_checkpoint_dyad_does_not_model_is_refused_naming_the_field(field, value, message, tmp_path):
    _saved(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    whole = {"model_type": "qwen3_vl_moe", "vision_config": config | {"model_type": "qwen3_vl_moe", field: value}}
    with pytest.raises(ValueError, match=message):
        qwen3_vl_vision_config(whole)
    (tmp_path / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(ValueError, match=message):
        dyad.hf.load(tmp_path)
