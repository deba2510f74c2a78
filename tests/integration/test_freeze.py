"""Staged training (`train.freeze`): a run holding the encoder, the LLM, or both but the projector
reproduces the single-process reference holding the same (`dyad verify`'s comparison), the held
parts end as they began, and a frozen encoder gets no gradient back over the boundary."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dyad import config as config_lib
from dyad.app.evaluate import load_trained
from dyad.app.verify import compare_with_reference
from dyad.data import make_dataset
from dyad.service import build_model
from tests.helpers.resilience import BASE, run_in_process

MODES = {  # case: (train.freeze, the layouts)
    "encoder": ("encoder", ["parallel.encoder.dp=2", "parallel.llm.tp=2"]),
    "llm": ("llm", ["parallel.encoder.tp=2", "parallel.llm.dp=2", "parallel.llm.ep=2"]),
    # the image rows' gradients through both stages of a frozen LLM
    "llm-pp2": ("llm", ["parallel.llm.pp=2", "parallel.llm.dp=2"]),
    "vision_tower,llm": ("vision_tower,llm", ["parallel.encoder.dp=2", "parallel.llm.cp=2"]),
}


def _held(name: str, frozen: list[str]) -> bool:
    pool, _, param = name.partition(".")
    if pool in frozen:
        return True
    return pool == "encoder" and "vision_tower" in frozen and not param.startswith(("proj_in.", "proj_out."))


@pytest.mark.parametrize("case", MODES)
def test_a_frozen_part_holds_and_the_rest_trains_as_on_one_device(case, tmp_path):
    frozen, layouts = MODES[case]
    config = config_lib.load(None, [*BASE, "checkpoint.interval_steps=0", "train.steps=4", "eval.final=false",
                                    f"train.freeze=[{frozen}]", *layouts])
    config = dataclasses.replace(config, out_dir=str(tmp_path))
    job = run_in_process(config)
    assert job.succeeded, job.info.message
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    comparison = compare_with_reference(resolved, dataset, job)
    assert comparison.worst_loss_error <= 1e-5, comparison.losses
    assert comparison.worst_param_error <= 1e-5, (comparison.worst_param, comparison.worst_param_error)

    initial = {pool: build_model(resolved, pool, device="cpu").state_dict() for pool in ("encoder", "llm")}
    trained = dict(zip(("encoder", "llm"), load_trained(resolved, job.final_checkpoint())))
    held, moved = [], []
    for pool, model in trained.items():
        for name, value in model.state_dict().items():
            key = f"{pool}.{name}"
            (held if torch.equal(value, initial[pool][name]) else moved).append(key)
    parts = frozen.split(",")
    for key in held + moved:
        if _held(key, parts):
            assert key in held, f"{key} is frozen but changed"
    assert any(not _held(key, parts) for key in moved), "nothing trained"
    backward_bytes = [m["boundary_bytes_bwd"] for m in job.metrics]
    if "encoder" in parts:  # no gradient crosses the boundary
        assert backward_bytes == [0] * 4 and all(m["boundary_bytes_fwd"] > 0 for m in job.metrics)
    else:
        assert all(b > 0 for b in backward_bytes)


@pytest.mark.parametrize("freeze, message", [
    ("[encoder, llm]", r"train.freeze \['encoder', 'llm'\] leaves nothing to train"),
    ("[encoder, vision_tower]", "train.freeze names 'encoder' and 'vision_tower', parts of one pool: name one"),
    ("[projector]", "train.freeze must list distinct parts out of 'encoder', 'vision_tower', 'llm', got"),
    ("[llm, llm]", "train.freeze must list distinct parts"),
])
def test_a_freeze_that_cannot_train_is_refused_naming_the_field(freeze, message):
    with pytest.raises(ValueError, match=message):
        config_lib.load(None, [f"train.freeze={freeze}"])
