"""Qwen3-VL-MoE's language model (`Qwen3VLMoeForConditionalGeneration`'s `model.language_model`
and `lm_head`) loaded into dyad's `MoELM`: a tiny random one built and saved with transformers,
the same token embeddings with image rows spliced in, the same multimodal rotary positions (from
transformers' `get_rope_index`, images of three grid sizes over two samples, one right-padded)
and the same DeepStack rows through both: logits, loss, every LLM parameter's gradient and the
gradients of the image and DeepStack rows equal in float32 (1e-5 relative, in the max norm).
dyad's `rope_index` is transformers' `get_rope_index`; the fused experts load from either layout
a checkpoint may hold them in, and are written back as transformers saves them."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dyad.hf_checkpoint import HFCheckpoint
from dyad.llm_service.hf import hf_tensors, llm_state_dict
from dyad.llm_service.hf_config import llm_config
from dyad.llm_service.model import MoELM
from dyad.llm_service.rope_index import rope_index
from tests.helpers.hf_models import make_norms_and_biases_matter
from tests.helpers.parity import relative_error

transformers = pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e '.[test]')")

VOCAB, IMAGE, VISION_START, VISION_END = 64, 63, 62, 61
MERGE = 2
TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=128, rms_norm_eps=1e-6,
    router_aux_loss_coef=0.0, tie_word_embeddings=False,
    # 8 frequencies: t turns 0, 3, 6; h 1, 4, 7; w 2, 5
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [3, 3, 2], "mrope_interleaved": True},
)
VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=MERGE,
              temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
# Each image's patch grid (t, h, w) before the 2x2 merge: 2x3, 4x2 and 3x3 tokens.
GRIDS = [(1, 4, 6), (1, 8, 4), (1, 6, 6)]


def saved_model(path, **text_changes):
    torch.manual_seed(0)
    config = transformers.Qwen3VLMoeConfig(
        text_config=TEXT | text_changes, vision_config=VISION, image_token_id=IMAGE, video_token_id=60,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).float().eval()
    make_norms_and_biases_matter(model, bias_std=0.5)
    with torch.no_grad():  # routers that tell the experts apart
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(std=0.5)
    model.save_pretrained(path)
    return model


def load_llm(path) -> MoELM:
    checkpoint = HFCheckpoint(path)
    model = MoELM(llm_config(checkpoint.config))
    model.load_state_dict(llm_state_dict(checkpoint, model.cfg), strict=True)
    return model


def _image(grid) -> list[int]:
    t, h, w = grid
    return [VISION_START] + [IMAGE] * (t * h * w // MERGE**2) + [VISION_END]


def batch(grids=GRIDS):
    """Sample 0: text, image 0, text, image 1, text; sample 1: text, image 2, text, right-padded."""
    generator = torch.Generator().manual_seed(1)

    def text(n):
        return torch.randint(0, VISION_END, (n,), generator=generator).tolist()

    rows = [text(3) + _image(grids[0]) + text(2) + _image(grids[1]) + text(4), text(5) + _image(grids[2]) + text(3)]
    S = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), S, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)], attention_mask[b, : len(r)] = torch.tensor(r), 1
    mm_token_type_ids = (input_ids == IMAGE).int()
    return input_ids, attention_mask, mm_token_type_ids, torch.tensor(grids)


def _reference_forward(reference, input_ids, attention_mask, positions_3BS, image_rows_ND, deepstack):
    """transformers' language model and head, from the embeddings with the image rows in place."""
    image_mask_BS = input_ids == IMAGE
    embeds_BSD = reference.model.language_model.embed_tokens(input_ids)
    embeds_BSD = embeds_BSD.masked_scatter(image_mask_BS.unsqueeze(-1), image_rows_ND)
    hidden = reference.model.language_model(
        inputs_embeds=embeds_BSD, attention_mask=attention_mask, position_ids=positions_3BS,
        visual_pos_masks=image_mask_BS, deepstack_visual_embeds=deepstack,
    ).last_hidden_state
    return reference.lm_head(hidden)


def _assert_close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    error = relative_error(got.detach(), want.detach(), "max")
    assert error <= 1e-5, f"{what}: relative error {error:.2e} (max norm)"


def _loss(logits_BSV, labels_BS):
    return F.cross_entropy(logits_BSV[:, :-1].reshape(-1, VOCAB), labels_BS[:, 1:].reshape(-1), ignore_index=-100)


def test_logits_loss_and_gradients_match_transformers(tmp_path):
    reference = saved_model(tmp_path / "model")
    ours = load_llm(tmp_path / "model")
    input_ids, attention_mask, mm_token_type_ids, grids = batch()
    positions_3BS, _ = reference.model.get_rope_index(
        input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grids, attention_mask=attention_mask
    )
    labels = input_ids.masked_fill((attention_mask == 0) | (input_ids == IMAGE), -100)
    N, D = int((input_ids == IMAGE).sum()), TEXT["hidden_size"]
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randn(N, D, generator=generator) for _ in range(1 + len(VISION["deepstack_visual_indexes"]))]
    theirs = [r.clone().requires_grad_(True) for r in rows]
    mine = [r.clone().requires_grad_(True) for r in rows]

    expected_logits = _reference_forward(reference, input_ids, attention_mask, positions_3BS, theirs[0], theirs[1:])
    expected = _loss(expected_logits, labels)
    expected.backward()
    image_positions_N = (input_ids == IMAGE).flatten().nonzero().flatten()
    logits, _ = ours(input_ids, mine[0], image_positions_N, valid_BS=attention_mask.bool(),
                     rope_positions_3BS=positions_3BS, deepstack_embeds=mine[1:])
    loss = _loss(logits, labels)
    loss.backward()

    real = attention_mask.bool()
    _assert_close("logits", logits[real], expected_logits[real])
    _assert_close("loss", loss, expected)
    for name, got, want in zip(["image rows", "deepstack 0", "deepstack 1"], mine, theirs):
        _assert_close(f"{name}' gradient", got.grad, want.grad)
    with torch.no_grad():  # transformers' gradients saved under its names, read under dyad's
        for p in reference.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    reference.save_pretrained(tmp_path / "grads")
    grads = llm_state_dict(HFCheckpoint(tmp_path / "grads"), ours.cfg)
    named = dict(ours.named_parameters())
    assert set(named) == set(grads)
    for name, param in named.items():
        _assert_close(name, param.grad, grads[name])


def test_text_without_rope_positions_is_transformers_plain_positions(tmp_path):
    """No images, no rotary positions: every axis at the sequence position, as transformers'
    default."""
    reference = saved_model(tmp_path)
    ours = load_llm(tmp_path)
    input_ids = torch.randint(0, VISION_END, (2, 9), generator=torch.Generator().manual_seed(3))
    expected = reference.lm_head(reference.model.language_model(input_ids=input_ids).last_hidden_state)
    logits, _ = ours(input_ids)
    _assert_close("logits", logits, expected)


def test_rope_index_is_transformers_get_rope_index(tmp_path):
    """Three samples, images of four grids (one of two frames), right and left padding."""
    reference = saved_model(tmp_path)
    generator = torch.Generator().manual_seed(4)
    grids = [(1, 4, 6), (2, 8, 4), (1, 6, 6), (1, 2, 10)]

    def text(n):
        return torch.randint(0, VISION_END, (n,), generator=generator).tolist()

    rows = [
        text(2) + _image(grids[0]) + _image(grids[1]) + text(3),  # two images back to back
        _image(grids[2]) + text(4),  # an image first
        text(6) + _image(grids[3]),  # an image last
    ]
    S = max(len(r) for r in rows) + 2
    input_ids = torch.zeros(3, S, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, r in enumerate(rows):
        place = slice(S - len(r), S) if b == 1 else slice(0, len(r))  # sample 1 left-padded
        input_ids[b, place], attention_mask[b, place] = torch.tensor(r), 1
    mm_token_type_ids = (input_ids == IMAGE).int()
    expected, _ = reference.model.get_rope_index(
        input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=torch.tensor(grids), attention_mask=attention_mask
    )
    got = rope_index(mm_token_type_ids, torch.tensor(grids), attention_mask, spatial_merge_size=MERGE)
    assert torch.equal(got, expected)
    unpadded, _ = reference.model.get_rope_index(
        input_ids[:1], mm_token_type_ids=mm_token_type_ids[:1], image_grid_thw=torch.tensor(grids[:2])
    )
    assert torch.equal(rope_index(mm_token_type_ids[:1], torch.tensor(grids[:2]), spatial_merge_size=MERGE), unpadded)


@pytest.mark.parametrize("grids, message", [
    ([(1, 4, 6), (1, 8, 4)], "more image runs than image_grid_thw's 2 images"),
    ([(1, 4, 6), (1, 8, 4), (1, 6, 6), (1, 2, 2)], "image_grid_thw has 4 images, mm_token_type_ids only 3 image runs"),
    ([(1, 4, 6), (1, 8, 8), (1, 6, 6)], r"image 1: a run of 8 image tokens, its grid \[1, 8, 8\] merged by 2 gives 16"),
])
def test_rope_index_refuses_grids_that_do_not_fit_the_tokens(grids, message):
    _, attention_mask, mm_token_type_ids, _ = batch()
    with pytest.raises(ValueError, match=message):
        rope_index(mm_token_type_ids, torch.tensor(grids), attention_mask, spatial_merge_size=MERGE)


def test_fused_experts_load_from_the_hub_layout_too(tmp_path):
    """The hub's checkpoints store gate_up_proj [E, D, 2F] and down_proj [E, F, D], transposed
    from what transformers 5 saves: both read as the same model."""
    saved_model(tmp_path)
    saved = load_llm(tmp_path).state_dict()
    weights = load_file(tmp_path / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[name] = weights[name].transpose(1, 2).contiguous()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for name, value in load_llm(tmp_path).state_dict().items():
        assert torch.equal(value, saved[name]), name


def test_exported_tensors_are_what_transformers_saved(tmp_path):
    """`hf_tensors` of the loaded language model: the checkpoint's own tensors of it, bit for bit
    (the fused experts in transformers 5's layout)."""
    saved_model(tmp_path)
    ours = load_llm(tmp_path)
    exported = hf_tensors(ours.state_dict(), ours.cfg, "qwen3_vl_moe_text", decoder="model.language_model.")
    weights = {n: w for n, w in load_file(tmp_path / "model.safetensors").items() if not n.startswith("model.visual.")}
    assert exported.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(exported[name], value), name


def test_config_says_multimodal_rotary_and_the_whole_models_head(tmp_path):
    saved_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    cfg = llm_config(config)
    assert (cfg.mrope_section, cfg.qk_norm, cfg.head_dim, cfg.dense_layers) == ((3, 3, 2), "head", 16, (1,))
    assert cfg.moe.norm_topk_prob and cfg.moe.num_experts == 6
    tied = config | {"tie_word_embeddings": True, "text_config": config["text_config"] | {"tie_word_embeddings": False}}
    with pytest.raises(ValueError, match="config.json tie_word_embeddings=True is not supported"):
        llm_config(tied)
    untied = config | {"text_config": config["text_config"] | {"tie_word_embeddings": True}}
    assert llm_config(untied).mrope_section == (3, 3, 2)  # the text config's own flag is not the head's
    wide = config["text_config"]["rope_parameters"] | {"mrope_section": [2, 3, 3]}
    with pytest.raises(ValueError, match=r"llm.mrope_section \(\[2, 3, 3\]\): interleaved, .* w <= 2"):
        llm_config(config | {"text_config": config["text_config"] | {"rope_parameters": wide}})


@pytest.mark.parametrize("section, match", [
    ("[4,2,1]", r"llm.mrope_section \(\[4, 2, 1\]\) must be three counts \(t, h, w\) >= 0 summing to half .* \(8\)"),
    ("[4,4]", r"llm.mrope_section \(\[4, 4\]\) must be three counts"),
    ("[2,3,3]", r"llm.mrope_section \(\[2, 3, 3\]\): interleaved, .* h must be <= 3, w <= 2"),
    ("[1,4,3]", r"llm.mrope_section \(\[1, 4, 3\]\): interleaved, .* h must be <= 3, w <= 2"),
])
def test_an_mrope_section_that_does_not_fit_is_named(section, match):
    from dyad import config as config_lib

    assert config_lib.load(None, ["llm.mrope_section=[4,2,2]"]).llm.mrope_section == (4, 2, 2)  # llm.head_dim 16
    with pytest.raises(ValueError, match=match):
        config_lib.load(None, [f"llm.mrope_section={section}"])


def test_rope_positions_need_an_mrope_section_and_deepstack_rows_their_places():
    from dyad.llm_service.config import LLMConfig

    model = MoELM(LLMConfig(vocab_size=VOCAB))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"rope_positions need a multimodal rotary embedding \(llm.mrope_section\)"):
        model(ids, rope_positions_3BS=torch.zeros(3, 1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="deepstack_embeds need image_embeds and image_positions"):
        model(ids, deepstack_embeds=[torch.zeros(1, model.cfg.dim)])
    rows, positions = torch.zeros(2, model.cfg.dim), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"deepstack_embeds must have shape \[N, 64\], got \[2, 8\]"):
        model(ids, rows, positions, deepstack_embeds=[torch.zeros(2, 8)])
