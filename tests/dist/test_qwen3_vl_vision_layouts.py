"""Qwen3-VL's vision tower under encoder layouts (dp × tp) reproduces the single-device tower on a
batch of images of different patch grids: merged tokens, DeepStack features and every gradient
gathered to full shapes (float32, 1e-5, max norm). Each dp rank runs its own images; tp splits
the heads, the MLPs' hidden and the mergers' hidden; each rank reads its pieces of the tower from
a checkpoint of Hugging Face names (`qwen3_vl_sources`, the inverse of `qwen3_vl_tower_tensors`).
A layout that cannot split the tower is refused naming the width."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from dyad.encoder_service.config import Qwen3VLVisionConfig
from dyad.encoder_service.hf import qwen3_vl_sources, qwen3_vl_tower_tensors
from dyad.encoder_service.parallelize import parallelize_qwen3_vl_vision
from dyad.encoder_service.qwen3_vl import Qwen3VLVision
from dyad.hf_checkpoint import HFCheckpoint
from dyad.layout import EncoderLayout, validate_encoder_layout
from dyad.parallel.gradients import full_tensors
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.overlap import GradientReduction
from dyad.slices import load_pieces
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_tensors_close

CFG = Qwen3VLVisionConfig(patch_size=2, temporal_patch=2, channels=3, dim=32, depth=3, heads=4, mlp_hidden=48,
                          position_grid=4, spatial_merge=2, out_dim=24, deepstack_layers=(0, 2))
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 6, 4), (1, 2, 2)]  # dp rank r runs images r, r + dp, ...
X = 3 * 2 * 2 * 2


def _tower() -> Qwen3VLVision:
    torch.manual_seed(0)
    model = Qwen3VLVision(CFG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(mean=1.0 if "norm.weight" in name else 0.0, std=0.2 if "norm" in name else 0.3)
    return model


def _outputs(model, pixels, grid_thw) -> torch.Tensor:
    merged, deepstack = model(pixels, grid_thw)
    return torch.cat([merged, *deepstack], dim=1)  # [T, (1 + levels) * O]


def _body(rank, world_size, dp, tp, checkpoint):
    layout = EncoderLayout(dp=dp, tp=tp)
    validate_encoder_layout(layout, CFG)
    groups = ProcessGroups.build(layout)
    reference = _tower()
    model = Qwen3VLVision(CFG)
    reduction = GradientReduction(parallelize_qwen3_vl_vision(model, groups), groups)
    load_pieces(model, qwen3_vl_sources(HFCheckpoint(checkpoint), CFG))
    for name, value in full_tensors(model).items():
        assert torch.equal(value, dict(reference.named_parameters())[name]), name
    grids = torch.tensor(GRIDS)
    patches = grids.prod(1).tolist()
    images = torch.randn(sum(patches), X, generator=torch.Generator().manual_seed(1)).split(patches)
    expected = [_outputs(reference, image, grids[i : i + 1]) for i, image in enumerate(images)]
    upstream = [torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + i)) for i, x in enumerate(expected)]
    sum((x * g).sum() for x, g in zip(expected, upstream, strict=True)).backward()

    mine = list(range(groups.index("dp"), len(GRIDS), dp))
    out = _outputs(model, torch.cat([images[i] for i in mine]), grids[mine])
    reduction.arm()
    (out * torch.cat([upstream[i] for i in mine])).sum().backward()
    reduction.finish()
    assert_tensors_close({"out": out.detach()}, {"out": torch.cat([expected[i] for i in mine]).detach()}, "outputs")
    assert_tensors_close(full_tensors(model, grads=True), {n: p.grad for n, p in reference.named_parameters()}, "grad")


@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 2)])
def test_qwen3_vl_vision_layout_matches_single_device(dp, tp, tmp_path):
    save_file(qwen3_vl_tower_tensors(_tower().state_dict(), CFG, "model.visual."), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe"}))
    run_distributed(_body, dp * tp, dp, tp, str(tmp_path))


def test_a_tp_that_does_not_split_the_tower_is_refused_naming_the_width():
    with pytest.raises(ValueError, match=r"parallel.encoder: tp \(8\) must divide heads \(4\)"):
        validate_encoder_layout(EncoderLayout(tp=8), CFG)
    with pytest.raises(ValueError, match=r"parallel.encoder: tp \(4\) must divide mlp_hidden \(50\)"):
        validate_encoder_layout(EncoderLayout(tp=4), dataclasses.replace(CFG, mlp_hidden=50))
