"""A LLaVA (`LlavaForConditionalGeneration`: a SigLIP or CLIP tower, its projector and a Qwen3-MoE)
loaded by `dyad.hf.load` as dyad's encoder and LLM: a tiny random one built and saved with
transformers, the same token ids, image placeholders and pixels through both, logits, loss and
every parameter's gradient equal in float32 (1e-5 relative; each gradient in the max norm, as the
layout tests compare them). A LLaVA whose projector or feature selection dyad does not model is
refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

import dyad.hf
from dyad.encoder_service.hf import encoder_state_dict
from tests.helpers.hf_models import gradients_under_dyad_names, make_norms_and_biases_matter
from tests.helpers.parity import relative_error

transformers = pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e '.[test]')")

VOCAB, IMAGE_TOKEN = 48, 47
TOWER = dict(hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4, image_size=16,
             patch_size=8, num_channels=3)
TOWERS = {  # (vision config, LLaVA's feature selection: CLIP's class token dropped, SigLIP's tokens all kept)
    "siglip": (lambda: transformers.SiglipVisionConfig(**TOWER, vision_use_head=False), "full"),
    "clip": (lambda: transformers.CLIPVisionConfig(**TOWER), "default"),
}


def llava(tower: str, **overrides):
    vision, strategy = TOWERS[tower]
    text = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[0], norm_topk_prob=True, router_aux_loss_coef=0.0, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    config = transformers.LlavaConfig(
        vision_config=vision(), text_config=text, image_token_index=IMAGE_TOKEN, vision_feature_layer=-2,
        vision_feature_select_strategy=strategy, image_seq_length=4, tie_word_embeddings=False, **overrides,
    )
    return transformers.LlavaForConditionalGeneration(config)


def saved_llava(tower: str, path, **overrides):
    torch.manual_seed(0)
    model = llava(tower, **overrides).float().eval()
    make_norms_and_biases_matter(model, bias_std=0.2)
    model.save_pretrained(path)
    return model


def llava_inputs():
    """Two sequences, the first with two images and the second with one, each image's 4
    placeholders (a 16-pixel image of 8-pixel patches) in the text; the second right-padded."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, IMAGE_TOKEN, (2, 16), generator=generator)
    input_ids[0, 1:5] = input_ids[0, 8:12] = input_ids[1, 3:7] = IMAGE_TOKEN
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 12:] = 0
    labels = input_ids.masked_fill((attention_mask == 0) | (input_ids == IMAGE_TOKEN), -100)
    pixels = torch.randn(3, 3, 16, 16, generator=generator)
    return dict(input_ids=input_ids, pixel_values=pixels, attention_mask=attention_mask, labels=labels)


@pytest.mark.parametrize("tower", TOWERS)
def test_logits_loss_and_gradients_match_transformers(tower, tmp_path):
    reference = saved_llava(tower, tmp_path / "llava")
    ours = dyad.hf.load(tmp_path / "llava")
    assert isinstance(ours, dyad.hf.Llava)
    inputs = llava_inputs()
    expected, got = reference(**inputs), ours(**inputs)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got.logits[real], expected.logits[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=0)

    expected.loss.backward()
    got.loss.backward()
    grads = gradients_under_dyad_names(reference, ours, tmp_path / "grads", encoder_state_dict)
    named = dict(ours.named_parameters())
    assert set(grads) == set(named)
    for name, expected_grad in grads.items():
        error = relative_error(named[name].grad, expected_grad, "max")
        assert error <= 1e-5, f"{name}: relative error {error:.2e} (max norm)"


def test_fewer_placeholders_than_image_rows_is_refused(tmp_path):
    saved_llava("siglip", tmp_path)
    inputs = llava_inputs()
    inputs["input_ids"][0, 1] = 0
    with pytest.raises(ValueError, match="input_ids hold 11 image placeholders .id 47., the images give 12 rows"):
        dyad.hf.load(tmp_path)(**inputs)


@pytest.mark.parametrize("field, value, message", [
    ("projector_hidden_act", "relu", "projector_hidden_act='relu' is not supported for a LLaVA of a siglip tower"),
    ("vision_feature_select_strategy", "default",
     "vision_feature_select_strategy='default' is not supported for a LLaVA of a siglip tower .dyad's: 'full'."),
    ("vision_feature_layer", [-2, -1], r"vision_feature_layer=\[-2, -1\]: dyad takes the features of one layer"),
])
def test_a_llava_dyad_does_not_model_is_refused_naming_the_field(field, value, message, tmp_path):
    saved_llava("siglip", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(ValueError, match=message):
        dyad.hf.load(tmp_path)
