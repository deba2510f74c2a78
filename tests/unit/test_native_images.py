"""Native-resolution images (Qwen2-VL's processor, which Qwen3-VL-MoE's checkpoints name): dyad's
patches, grids and token counts against transformers' `Qwen2VLImageProcessorPil` on images of
several sizes, aspect ratios and modes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from dyad.data import read_image_processor
from dyad.data.image_processor import PatchGrid
from dyad.data.pixels import patches
from tests.helpers.conversations import write_images

transformers = pytest.importorskip("transformers", reason="transformers is the test reference")

QWEN3_VL = {"image_processor_type": "Qwen2VLImageProcessorFast",
            "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor"}
QWEN2_VL = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": 112 * 112,
            "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "resample": 3}
# (width, height): below min_pixels, above max_pixels, in between, already a multiple of patch *
# merge, 1:12; then a transparent one and a grey one


def _files(root):
    names = (write_images(root, [(37, 23), (300, 90), (100, 70), (64, 96), (24, 290)])
             + write_images(root, [(90, 41)], "RGBA") + write_images(root, [(77, 77)], "L"))
    return [root / name for name in names]


def _processor_dir(root, config):
    root.mkdir()
    (root / "preprocessor_config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("config", [QWEN3_VL, QWEN2_VL], ids=["qwen3_vl", "qwen2_vl"])
def test_patches_and_grids_are_transformers_qwen2_vl_processors(tmp_path, config):
    processor = read_image_processor(_processor_dir(tmp_path / "ckpt", config))
    settings = {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
    reference = transformers.Qwen2VLImageProcessorPil(**settings)
    files = _files(tmp_path)
    images = [Image.open(f) for f in files]
    expected = reference(images, return_tensors="np")
    pixel_values_PD, grid_thw_N3 = patches(files, processor, "cpu")
    assert grid_thw_N3.tolist() == expected["image_grid_thw"].tolist()
    assert pixel_values_PD.dtype == torch.float32 and grid_thw_N3.dtype == torch.int64
    assert pixel_values_PD.shape == expected["pixel_values"].shape
    assert np.abs(pixel_values_PD.numpy() - expected["pixel_values"]).max() <= 1e-6
    merge = config["merge_size"]
    for image in images:  # torch-free, from the size alone: what the router plans with
        patches_of_image = reference.get_number_of_image_patches(image.height, image.width)
        assert processor.patches.image_tokens(image.height, image.width) == patches_of_image // merge**2


def test_no_image_gives_empty_patches(tmp_path):
    processor = read_image_processor(_processor_dir(tmp_path / "ckpt", QWEN3_VL))
    pixel_values_PD, grid_thw_N3 = patches([], processor, None)
    assert pixel_values_PD.shape == (0, 3 * 2 * 16 * 16) and grid_thw_N3.shape == (0, 3)


@pytest.mark.parametrize("change, message", [
    ({"do_resize": False}, "do_resize false"),
    ({"size": {"shortest_edge": 512, "longest_edge": 256}}, "min_pixels <= max_pixels"),
    ({"image_processor_type": "Qwen2VLImageProcessorSlow"}, "image_processor_type 'Qwen2VLImageProcessorSlow'"),
])
def test_processor_configs_dyad_cannot_follow_are_refused_naming_the_field(tmp_path, change, message):
    directory = _processor_dir(tmp_path / "ckpt", {**QWEN3_VL, **change})
    with pytest.raises(ValueError, match=f"encoder.from_hf: .*{message}"):
        read_image_processor(directory)


def test_an_image_too_narrow_for_smart_resize_is_refused():
    grid = PatchGrid(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=1024, max_pixels=4096)
    assert grid.image_tokens(200, 1) > 0
    with pytest.raises(ValueError, match="aspect ratio is over 200"):
        grid.image_tokens(201, 1)
