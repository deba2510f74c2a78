"""Encoder layouts (dp × tp) reproduce the single-device encoder: outputs, gradients gathered to
full shapes, gradient norm and updated parameters (float32, 1e-5, max norm, every step). Plain
SGD steps the models, for the reason given in tests/dist/test_llm_layouts.py; with the optimizer
sharded over dp (`ShardedOptimizer`), AdamW against the reference's: outputs and norms every
step, the first step's gradients, the parameters after the steps (2-norm, tests/helpers/parity.py),
and each rank's optimizer state a dp-th of the reference's."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dyad import config as config_lib
from dyad.clipping import clip_scale
from dyad.encoder_service.parallelize import parallelize_encoder
from dyad.layout import EncoderLayout, validate_encoder_layout
from dyad.parallel.groups import ProcessGroups
from dyad.service import build_model
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_close, assert_tensors_close
from tests.helpers.sharding import Stepper, assert_state_split


# The parts of pretrained towers: CLIP's (a class token, a norm before the blocks, quick GELU, no
# patch bias) and SigLIP's (tanh GELU, no final norm as LLaVA reads its features), with q/k/v biases.
TOWER_PARTS = {
    "clip": ["encoder.cls_token=true", "encoder.pre_norm=true", "encoder.activation=quick_gelu",
             "encoder.patch_bias=false", "encoder.qkv_bias=true", "encoder.mlp_hidden=40"],
    "siglip": ["encoder.activation=gelu_tanh", "encoder.final_norm=false", "encoder.qkv_bias=true"],
}


def _encoder_body(rank, world_size, dp, tp, merge, parts=(), shard=False):
    layout = EncoderLayout(dp=dp, tp=tp)
    overrides = ["encoder.heads=4", "train.grad_clip=0.1", f"encoder.spatial_merge={merge}", *parts]
    config = config_lib.resolve(config_lib.load(None, overrides), vocab_size=32)
    tokens = config.encoder.tokens_per_image
    validate_encoder_layout(layout, config.encoder)
    groups = ProcessGroups.build(layout)
    reference = build_model(config, "encoder")
    model = copy.deepcopy(reference)
    plan = parallelize_encoder(model, groups)
    stepper = Stepper(reference, model, plan, groups, config.train, shard, bucket_bytes=16 * 2**10)  # many buckets
    for step in range(3):
        images = torch.rand(2 * dp, 1, 16, 16, generator=torch.Generator().manual_seed(step))
        upstream = torch.randn(2 * dp, tokens, config.encoder.out_dim,
                               generator=torch.Generator().manual_seed(99 + step))
        expected = reference(images)
        (expected * upstream).sum().backward()
        mine = slice(2 * groups.index("dp"), 2 * groups.index("dp") + 2)  # this dp rank's images
        out = model(images[mine])
        stepper.reduction.arm()  # as the encoder worker does before its step's last backward
        (out * upstream[mine]).sum().backward()
        assert_tensors_close({"out": out.detach()}, {"out": expected[mine].detach()}, f"step {step}")
        stepper.reduction.finish()
        stepper.check_gradients(step)
        ref_sq, sq = stepper.grad_sq_norms()
        assert_close(math.sqrt(sq), math.sqrt(ref_sq), f"step {step} grad norm")
        stepper.update(clip_scale(ref_sq, config.train.grad_clip), clip_scale(sq, config.train.grad_clip))
    stepper.check_parameters()
    if shard:
        assert_state_split(stepper.shards, stepper.ref_optimizer, replicas=dp)


# merge: encoder.spatial_merge (2: the tensor-parallel projector reads merged 2 x 2 squares)
@pytest.mark.parametrize("dp, tp, merge", [(2, 1, 1), (1, 2, 2), (2, 2, 1)])
def test_encoder_layout_matches_single_device(dp, tp, merge):
    run_distributed(_encoder_body, dp * tp, dp, tp, merge)


@pytest.mark.parametrize("tower", TOWER_PARTS)
def test_pretrained_towers_parts_under_dp_and_tp_match_single_device(tower):
    run_distributed(_encoder_body, 4, 2, 2, 1, TOWER_PARTS[tower])


@pytest.mark.parametrize("dp", [2, 3])
def test_sharded_optimizer_under_dp_matches_single_device_adamw(dp):
    run_distributed(_encoder_body, dp, dp, 1, 1, (), True)
