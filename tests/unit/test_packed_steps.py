"""Packing planned by the router (`train.seq_len`): a microbatch's samples go into rows of at
most that many tokens, first fit, longest first; the boundary plan sees the packed rows; and
training the same samples packed gives the losses and gradients of training them one to a row
(float32, 1e-5 relative: the rows hold other padding, so sums run in other orders), for
dyad's own models on the digits and for a tiny Qwen3-VL-MoE (multimodal rotary positions
restarting at each packed sample, DeepStack levels in the image rows)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dyad import config as config_lib
from dyad.app.reference import ReferenceTrainer
from dyad.app.verify import relative_error, tensor_relative_error
from dyad.data import make_dataset
from dyad.data.batch import collate
from dyad.router.packing import pack_rows
from dyad.router.steps import StepPlanner, step_command
from tests.helpers.native_images import native_conversations, qwen3_vl_checkpoint

TOLERANCE = 1e-5
STEPS = 3


def test_samples_go_first_fit_longest_first_into_rows_ordered_by_their_first_sample():
    assert pack_rows([5, 9, 7, 3], 12) == [[0, 2], [1, 3]]  # 9 | 7, then 5 after the 7, 3 after the 9
    assert pack_rows([4, 4, 4], 12) == [[0, 1, 2]]
    assert pack_rows([4, 4, 4], 4) == [[0], [1], [2]]
    with pytest.raises(ValueError, match=r"a sample of 13 tokens does not fit a packed row of train.seq_len \(12\)"):
        pack_rows([5, 13], 12)


def _digits(*overrides):
    config = config_lib.load(None, ["train.global_batch=12", "train.microbatches=2", "train.warmup_steps=1",
                                    "data.multi_image_fraction=0.3", "data.text_only_fraction=0.2", *overrides])
    dataset = make_dataset(config.data)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset


def _qwen3_vl(tmp_path, *overrides):
    checkpoint = tmp_path / "qwen3-vl"
    qwen3_vl_checkpoint(checkpoint)
    data, tokenizer = native_conversations(tmp_path)
    run = tmp_path / "run.yaml"
    run.write_text(f"data: {{name: conversations, channels: 3}}\nllm: {{from_hf: {checkpoint}}}\n")
    config = config_lib.load(run, [
        f"data.path={data}", f"data.tokenizer={tokenizer}", f"encoder.from_hf={checkpoint}", "train.global_batch=8",
        "train.microbatches=2", "train.warmup_steps=1", *overrides,
    ])
    dataset = make_dataset(config.data)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset


def _gradients_at_each_update(trainer: ReferenceTrainer) -> list[dict[str, torch.Tensor]]:
    """Each step's gradients of both models, as their optimizers are about to step."""
    steps = []
    for pool, model, optimizer in zip(("encoder", "llm"), (trainer.encoder, trainer.llm), trainer.optimizers, strict=True):
        def capture(*_, pool=pool, model=model):
            if pool == "encoder":
                steps.append({})
            steps[-1] |= {f"{pool}.{name}": p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        optimizer.register_step_pre_hook(capture)
    return steps


@pytest.mark.parametrize("model", ["digits", "qwen3-vl-moe"])
def test_packed_training_is_unpacked_training(tmp_path, model):
    """Every step's losses and gradient norm, and every gradient on the same weights (the first
    step's: after it, float32 rounding that differs in the 7th digit, which AdamW's normalised
    update carries into the weights of near-zero gradients, makes the weights differ a little)."""
    config, dataset = _digits() if model == "digits" else _qwen3_vl(tmp_path)
    longest = max(dataset.shape(s, StepPlanner(config, dataset).image_tokens).seq_len for s in dataset.train_ids)
    packed_config = dataclasses.replace(config, train=dataclasses.replace(config.train, seq_len=2 * longest))
    unpacked, packed = ReferenceTrainer(config, dataset), ReferenceTrainer(packed_config, dataset)
    expected_grads, got_grads = _gradients_at_each_update(unpacked), _gradients_at_each_update(packed)
    plans = StepPlanner(packed_config, dataset)  # what the packed trainer's steps plan
    rows = samples = 0
    for step in range(STEPS):
        spec = plans.next(step)
        rows, samples = rows + sum(len(sizes) for sizes in spec.row_sizes), samples + len(sum(spec.microbatches, ()))
        expected, got = unpacked.step(step), packed.step(step)
        for key in ("loss", "lm_loss", "aux_loss", "grad_norm"):
            assert relative_error(expected[key], got[key]) <= TOLERANCE, (step, key, expected[key], got[key])
    assert expected_grads[0].keys() == got_grads[0].keys()  # on the same weights: the first step's
    for name, grad in expected_grads[0].items():
        assert tensor_relative_error(grad, got_grads[0][name]) <= TOLERANCE, name
    assert rows < samples  # the rows did hold several samples
    if model == "qwen3-vl-moe":
        assert config.llm.deepstack_levels == 1 and config.llm.mrope_section


def test_the_boundary_plan_and_every_llm_rank_see_the_packed_rows():
    config, dataset = _digits("train.seq_len=96", "parallel.llm.dp=2", "parallel.llm.cp=2")
    planner = StepPlanner(config, dataset)
    spec = planner.next(0)
    plan = planner.boundary_plan(spec)
    command = step_command(spec, plan)
    for index, (sample_ids, sizes) in enumerate(zip(spec.microbatches, spec.row_sizes)):
        assert list(command.microbatches[index].row_sizes) == list(sizes) and sum(sizes) == len(sample_ids)
        batch = collate(dataset.tokenizer, [dataset.sample(s) for s in sample_ids], planner.image_tokens, sizes)
        assert batch.input_ids.shape[0] == len(sizes) and int(batch.lengths.max()) <= 96
        planned = [r.rows for r in plan.local_rows if r.microbatch == index]
        assert sum(planned) == batch.image_positions.numel() * config.parallel.llm.tp
        for b, row in enumerate(batch.documents):  # each row's samples one after another, counted across rows
            held = row[row >= 0]
            assert torch.equal(held, held.sort().values) and held.unique().numel() == sizes[b]
