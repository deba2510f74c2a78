"""The whole Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`), and the dense Qwen3-VL
(`Qwen3VLForConditionalGeneration`), loaded by `dyad.hf.load` as dyad's `Qwen3VLVision` and
`MoELM`: a tiny random one built and saved with transformers, the same processor-shaped inputs
(`input_ids`, a right-padded `attention_mask`, `pixel_values` of four images of three patch grids
over two conversations, `image_grid_thw`, `mm_token_type_ids`, `labels`) through both: logits,
loss and every parameter's gradient equal in float32 (1e-5 relative, in the max norm). Exported by
`dyad.hf.qwen3_vl_to_hf`, transformers' `from_pretrained` gives back the checkpoint's tensors bit
for bit and dyad's logits. Inputs transformers would misread are refused naming them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dyad.hf
from dyad.encoder_service.hf import qwen3_vl_state_dict
from tests.helpers.hf_models import gradients_under_dyad_names, make_norms_and_biases_matter
from tests.helpers.parity import relative_error

transformers = pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e '.[test]')")

VOCAB, IMAGE, VISION_START, VISION_END = 64, 63, 62, 61
MERGE = 2
TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
    # 8 frequencies: t turns 0, 3, 6; h 1, 4, 7; w 2, 5
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [3, 3, 2], "mrope_interleaved": True},
)
MOE = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
           router_aux_loss_coef=0.0)
VISION = dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=MERGE,
              temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
MODELS = {  # model_type: (config class, model class, text config)
    "qwen3_vl_moe": (transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration, TEXT | MOE),
    "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration, TEXT),
}
# Each image's patch grid (t, h, w) before the 2x2 merge: 2x3, 4x2, 3x3 and 1x2 tokens.
GRIDS = [(1, 4, 6), (1, 8, 4), (1, 6, 6), (1, 2, 4)]
X = 3 * 2 * 4 * 4  # a flattened patch: channels * temporal * patch * patch


def saved_model(path, family="qwen3_vl_moe"):
    config, model, text = MODELS[family]
    torch.manual_seed(0)
    config = config(text_config=text, vision_config=VISION, image_token_id=IMAGE, video_token_id=60,
                    vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=False)
    reference = model(config).float().eval()
    make_norms_and_biases_matter(reference, bias_std=0.5)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("mlp.gate.weight"):  # routers that tell the experts apart
                p.normal_(std=0.5)
            elif name.endswith("pos_embed.weight"):  # resampling errors would hide at N(0, 0.02²)
                p.normal_()
    reference.save_pretrained(path)
    return reference


def _image(grid) -> list[int]:
    t, h, w = grid
    return [VISION_START] + [IMAGE] * (t * h * w // MERGE**2) + [VISION_END]


def inputs(grids=GRIDS) -> dict[str, torch.Tensor]:
    """Two conversations as Qwen3-VL's processor gives them: the first text, image 0, text,
    image 1, text; the second text, image 2, text, image 3, text, right-padded."""
    generator = torch.Generator().manual_seed(1)

    def text(n):
        return torch.randint(0, VISION_END, (n,), generator=generator).tolist()

    rows = [text(3) + _image(grids[0]) + text(2) + _image(grids[1]) + text(4),
            text(5) + _image(grids[2]) + text(3) + _image(grids[3]) + text(2)]
    S = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), S, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)], attention_mask[b, : len(r)] = torch.tensor(r), 1
    assert attention_mask[1].sum() < S  # the second is padded
    grid_thw = torch.tensor(grids)
    return dict(
        input_ids=input_ids, attention_mask=attention_mask,
        pixel_values=torch.randn(int(grid_thw.prod(1).sum()), X, generator=generator), image_grid_thw=grid_thw,
        mm_token_type_ids=(input_ids == IMAGE).int(),
        labels=input_ids.masked_fill((attention_mask == 0) | (input_ids == IMAGE), -100),
    )


def _assert_close(what: str, got: torch.Tensor, want: torch.Tensor) -> float:
    error = relative_error(got.detach(), want.detach(), "max")
    assert error <= 1e-5, f"{what}: relative error {error:.2e} (max norm)"
    return error


@pytest.mark.parametrize("family", MODELS)
def test_logits_loss_and_gradients_match_transformers(family, tmp_path):
    reference = saved_model(tmp_path / "model", family)
    ours = dyad.hf.load(tmp_path / "model")
    assert isinstance(ours, dyad.hf.Qwen3VL)
    batch = inputs()
    expected, got = reference(**batch), ours(**batch)
    real = batch["attention_mask"].bool()
    _assert_close("logits", got.logits[real], expected.logits[real])
    _assert_close("loss", got.loss, expected.loss)

    expected.loss.backward()
    got.loss.backward()
    grads = gradients_under_dyad_names(reference, ours, tmp_path / "grads", qwen3_vl_state_dict)
    named = dict(ours.named_parameters())
    assert grads.keys() == named.keys()
    for name, expected_grad in grads.items():
        _assert_close(name, named[name].grad, expected_grad)


def test_text_alone_is_transformers_plain_positions(tmp_path):
    """No images: no rotary positions from mm_token_type_ids, every axis counts the sequence."""
    reference = saved_model(tmp_path)
    ours = dyad.hf.load(tmp_path)
    batch = inputs()
    text = {"input_ids": batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE, 7),
            "attention_mask": batch["attention_mask"], "mm_token_type_ids": torch.zeros_like(batch["input_ids"])}
    with torch.no_grad():
        expected, got = reference(**text).logits, ours(**text).logits
    real = batch["attention_mask"].bool()
    _assert_close("logits", got[real], expected[real])


@pytest.mark.parametrize("family", MODELS)
def test_an_export_is_the_checkpoint_and_transformers_computes_dyads_logits(family, tmp_path):
    """`qwen3_vl_to_hf` of the loaded model: the saved tensors bit for bit, and transformers'
    `from_pretrained` of them (the source's config.json) gives dyad's logits."""
    saved_model(tmp_path / "model", family)
    ours = dyad.hf.load(tmp_path / "model")
    source = json.loads((tmp_path / "model" / "config.json").read_text())
    tensors, config = dyad.hf.qwen3_vl_to_hf(ours.encoder.state_dict(), ours.encoder.cfg, ours.llm.state_dict(),
                                             ours.llm.cfg, source)
    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert tensors.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(tensors[name], value), name

    (tmp_path / "out").mkdir()
    save_file(tensors, tmp_path / "out" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    exported = MODELS[family][1].from_pretrained(tmp_path / "out").float().eval()
    batch = inputs()
    with torch.no_grad():
        expected, got = exported(**batch).logits, ours(**batch).logits
    real = batch["attention_mask"].bool()
    _assert_close("logits", got[real], expected[real])


def _left_padded(batch):
    batch["attention_mask"] = batch["attention_mask"].flip(1)
    return batch


@pytest.mark.parametrize("change, message", [
    (_left_padded, r"attention_mask must be right-padded"),
    (lambda b: b | {"mm_token_type_ids": None}, "images need mm_token_type_ids"),
    (lambda b: b | {"image_grid_thw": None}, "pixel_values and image_grid_thw must be given together"),
    (lambda b: b | {"mm_token_type_ids": torch.zeros_like(b["input_ids"])},
     rf"mm_token_type_ids must mark as images \(1\) exactly the image placeholders \(input_ids == {IMAGE}\)"),
    (lambda b: b | {"image_grid_thw": torch.tensor([(1, 4, 6), (1, 8, 4), (1, 6, 6)])},
     r"pixel_values must have shape \[92, 96\] \(grid_thw's patches"),
    (lambda b: b | {"image_grid_thw": torch.tensor([(1, 8, 4), (1, 4, 6), (1, 6, 6), (1, 2, 4)])},  # out of order
     r"image 0: a run of 6 image tokens, its grid \[1, 8, 4\] merged by 2 gives 8"),
    (lambda b: b | {"pixel_values": None, "image_grid_thw": None},
     rf"input_ids hold 25 image placeholders \(id {IMAGE}\), the images give 0 rows"),
])
def test_inputs_transformers_would_misread_are_refused(change, message, loaded):
    with pytest.raises(ValueError, match=message):
        loaded(**change(inputs()))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    saved_model(path)
    return dyad.hf.load(path)
