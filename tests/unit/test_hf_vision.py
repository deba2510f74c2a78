"""Hugging Face vision towers (SigLIP, CLIP) loaded into dyad's encoder (`dyad.hf.load`): tiny
random towers built and saved with transformers, the same pixels through both,
`last_hidden_state` and every loaded parameter's gradient equal (float32: 1e-5 relative, each
gradient in the max norm as the layout tests compare them, tests/helpers/parity.py; float64:
1e-12); and the features a
LLaVA-style run takes (a feature layer before the last, no final norm, no class token) are
transformers' `hidden_states[feature_layer]`."""

from __future__ import annotations

import pytest
import torch

import dyad.hf
from dyad.encoder_service.hf import encoder_state_dict
from dyad.encoder_service.hf_config import encoder_config
from dyad.encoder_service.model import VisionEncoder
from dyad.hf_checkpoint import HFCheckpoint
from tests.helpers.hf_models import make_norms_and_biases_matter
from tests.helpers.parity import relative_error

transformers = pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e '.[test]')")

COMMON = dict(hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4, image_size=16,
              patch_size=4, num_channels=3)
TOWERS = {
    "siglip": lambda: transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**COMMON, vision_use_head=False)),
    "clip": lambda: transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**COMMON)),
}


def _saved(family, path):
    torch.manual_seed(0)
    tower = TOWERS[family]().float().eval()
    make_norms_and_biases_matter(tower, bias_std=0.2)
    tower.save_pretrained(path)
    return tower


def _pixels():
    return torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["float32", "float64"])
@pytest.mark.parametrize("family", TOWERS)
def test_last_hidden_state_and_gradients_match_transformers(family, dtype, rtol, tmp_path):
    reference = _saved(family, tmp_path).to(dtype)
    ours = dyad.hf.load(tmp_path, dtype=dtype)
    pixels = _pixels().to(dtype)
    expected = reference(pixel_values=pixels).last_hidden_state
    got = ours(pixels).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol / 10)

    upstream = torch.randn_like(expected)
    (expected * upstream).sum().backward()
    (got * upstream).sum().backward()
    # transformers' gradients as a checkpoint of its own names, read back under dyad's
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    reference.save_pretrained(tmp_path / "grads")
    grads = encoder_state_dict(HFCheckpoint(tmp_path / "grads"), ours.model.cfg)
    named = dict(ours.model.named_parameters())
    assert set(grads) == {name for name in named if not name.startswith("proj_")}
    for name, expected_grad in grads.items():
        error = relative_error(named[name].grad, expected_grad.to(dtype), "max")
        assert error <= rtol, f"{name}: relative error {error:.2e} (max norm)"
    # The key bias's true gradient is zero: transformers' is rounding noise, dyad holds it at zero.
    D = ours.model.cfg.dim
    for i in range(ours.model.cfg.depth):
        bias_grad = named[f"blocks.{i}.qkv.bias"].grad
        assert torch.count_nonzero(bias_grad[D : 2 * D]) == 0 and torch.count_nonzero(bias_grad[:D]) > 0


@pytest.mark.parametrize("family", TOWERS)
@pytest.mark.parametrize("feature_layer", [-2, -1])
def test_llava_features_are_the_hidden_states_of_the_feature_layer(family, feature_layer, tmp_path):
    reference = _saved(family, tmp_path)
    checkpoint = HFCheckpoint(tmp_path)
    cfg = encoder_config(checkpoint.config, feature_layer=feature_layer)
    assert cfg.depth == 3 + 1 + feature_layer and not cfg.final_norm
    encoder = VisionEncoder(cfg)
    encoder.load_state_dict(encoder_state_dict(checkpoint, cfg), strict=False)
    pixels = _pixels()
    hidden = reference(pixel_values=pixels, output_hidden_states=True).hidden_states[feature_layer]
    expected = hidden[:, 1:] if family == "clip" else hidden  # LLaVA's "default": no class token
    with torch.no_grad():
        assert relative_error(encoder.features(pixels), expected, "max") <= 1e-5


def test_a_feature_layer_outside_the_tower_is_refused(tmp_path):
    _saved("siglip", tmp_path)
    with pytest.raises(ValueError, match=r"encoder.feature_layer \(-4\) must be in \[-3, -1\]"):
        encoder_config(HFCheckpoint(tmp_path).config, feature_layer=-4)


def test_a_native_resolution_siglip2_tower_is_refused_pointing_at_the_fixed_resolution_ones():
    with pytest.raises(ValueError, match="'siglip2_vision_model' is not one dyad loads .SigLIP2's native-resolution"):
        encoder_config({"model_type": "siglip2_vision_model", "num_hidden_layers": 2})


def test_a_patch_that_does_not_divide_the_image_reads_what_transformers_convolution_reads(tmp_path):
    """SigLIP-so400m-patch14-384's case in small: 18-pixel images of 4-pixel patches, 4 x 4 patches
    and the last 2 pixel rows and columns unread, as the strided convolution leaves them."""
    torch.manual_seed(0)
    reference = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        **COMMON | {"image_size": 18}, vision_use_head=False)).float().eval()
    reference.save_pretrained(tmp_path)
    ours = dyad.hf.load(tmp_path)
    pixels = torch.randn(2, 3, 18, 18, generator=torch.Generator().manual_seed(1))
    expected = reference(pixel_values=pixels).last_hidden_state
    assert expected.shape[1] == 16
    torch.testing.assert_close(ours(pixels).last_hidden_state, expected, rtol=1e-5, atol=1e-6)
