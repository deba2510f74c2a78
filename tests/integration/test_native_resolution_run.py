"""A run whose encoder pool runs Qwen3-VL's native-resolution tower (`encoder.from_hf` at a tiny
random Qwen3-VL-MoE saved by transformers) on conversations whose images have four sizes, each
giving its own number of tokens: the tower starts as transformers' (its merged tokens on the
dataset's images), and the run's losses and updated parameters match the single-process reference
at every step. With dyad's own LLM (encoder dp1 -> LLM dp1) only the merged tokens cross and the
DeepStack mergers are held; with the checkpoint's own LLM too (`llm.from_hf`: multimodal rotary
positions from each image's grid, a DeepStack level in every image row) under encoder dp1 -> LLM
tp2·ep2, dp3 -> cp2·dp2 (its samples packed into rows), tp2 -> dp2 and dp1 -> pp2 (packed), the
DeepStack mergers train with the rest; the held-out loss the pools report is the trained model's
on one device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dyad.hf
from dyad import config as config_lib
from dyad.app.cli import main
from dyad.app.evaluate import heldout_loss, load_trained
from dyad.app.verify import compare_with_reference
from dyad.checkpoint import load_pool_state
from dyad.data import make_dataset
from dyad.data.batch import collate
from dyad.encoder_service.hf import qwen3_vl_state_dict
from dyad.encoder_service.hf_config import image_processor
from dyad.encoder_service.step import encode_rows
from dyad.encoder_service.worker import EncoderWorker
from dyad.hf_checkpoint import HFCheckpoint
from dyad.router.steps import StepPlanner
from dyad.service import build_model
from tests.helpers.native_images import native_conversations, qwen3_vl_checkpoint
from tests.helpers.resilience import run_in_process

transformers = pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e '.[test]')")

TOLERANCE = 1e-5
LAYOUTS = {
    "enc-dp1-llm-dp1": [],  # dyad's LLM: the merged tokens alone cross, the DeepStack mergers held
    # Qwen3-VL-MoE's own LLM (llm.from_hf): multimodal rotary positions, a DeepStack level per row
    "whole-enc-dp1-llm-tp2-ep2": ["parallel.llm.tp=2", "parallel.llm.ep=2"],
    # and packed: two samples a microbatch in rows of up to 256 tokens
    "whole-enc-dp3-llm-cp2-dp2-packed": ["parallel.encoder.dp=3", "parallel.llm.cp=2", "parallel.llm.dp=2",
                                         "train.global_batch=8", "train.seq_len=256"],
    "whole-enc-tp2-llm-dp2": ["parallel.encoder.tp=2", "parallel.llm.dp=2", "eval.final=true"],
    # and in two pipeline stages of a layer each, packed: the first stage alone takes the rows,
    # DeepStack's level with them, and returns their gradients
    "whole-enc-dp1-llm-pp2-packed": ["parallel.llm.pp=2", "train.seq_len=256", "eval.final=true"],
}


def _config(tmp_path, *overrides, whole: bool = False):
    """The run's config (`whole`: its LLM the checkpoint's too), dataset and transformers' model."""
    checkpoint = tmp_path / "qwen3-vl"
    reference = qwen3_vl_checkpoint(checkpoint)
    data, tokenizer = native_conversations(tmp_path)
    run = None
    if whole:  # a run file, so that no LLM field of the embedded default contradicts the checkpoint
        run = tmp_path / "run.yaml"
        run.write_text(f"data: {{name: conversations, channels: 3}}\nllm: {{from_hf: {checkpoint}}}\n")
    config = config_lib.load(run, [
        "data.name=conversations", f"data.path={data}", f"data.tokenizer={tokenizer}", "data.channels=3",
        f"encoder.from_hf={checkpoint}", "train.steps=3", "train.warmup_steps=1", "train.global_batch=4",
        "train.microbatches=2", "checkpoint.interval_steps=0", "eval.final=false", *overrides,
    ])
    config = dataclasses.replace(config, out_dir=str(tmp_path / "run"))
    dataset = make_dataset(config.data)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset, reference


@torch.no_grad()
def test_the_encoder_starts_as_transformers_tower(tmp_path):
    config, dataset, reference = _config(tmp_path)
    encoder = build_model(config, "encoder", device="cpu")
    image_ids = list(range(4))  # the four sizes
    rows_ND = encode_rows(encoder, dataset, image_ids, "cpu", image_processor(config.encoder))
    pixel_values, grid_thw = dataset.patches(image_ids, image_processor(config.encoder))
    expected_ND = reference.model.visual(pixel_values, grid_thw=grid_thw).pooler_output
    assert rows_ND.shape == expected_ND.shape == (int(grid_thw.prod(1).sum()) // 4, config.llm.dim)
    assert float((rows_ND - expected_ND).abs().max() / expected_ND.abs().max()) <= 1e-5


def test_what_train_freeze_holds_of_the_tower(tmp_path):
    config, _, _ = _config(tmp_path)
    cases = (((), ("blocks.", "merger.", "patch_embed.", "pos_embed_GD")), (("vision_tower",), ("merger.",)),
             (("encoder",), ()))
    for freeze, trained in cases:
        encoder = build_model(config, "encoder", device="cpu")
        EncoderWorker.freeze(encoder, dataclasses.replace(config, train=dataclasses.replace(config.train, freeze=freeze)))
        for name, param in encoder.named_parameters():  # the DeepStack mergers always held
            assert param.requires_grad == name.startswith(trained), (freeze, name)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_native_resolution_run_matches_single_process(tmp_path, layout):
    config, dataset, _ = _config(tmp_path, *LAYOUTS[layout], whole=layout.startswith("whole"))
    if layout.startswith("whole"):
        assert (config.llm.mrope_section, config.llm.deepstack_levels) == ((8, 4, 4), 1)
    if layout.endswith("packed"):  # some row holds two samples
        assert max(max(sizes) for sizes in StepPlanner(config, dataset).next(0).row_sizes) == 2
    job = run_in_process(config)
    assert job.succeeded, job.info.message
    comparison = compare_with_reference(config, dataset, job)
    for step, loss, expected, error in comparison.losses:
        assert error <= TOLERANCE, f"step {step}: {loss} vs reference {expected}"
    assert comparison.worst_param_error <= TOLERANCE, comparison.worst_param

    pretrained = qwen3_vl_state_dict(HFCheckpoint(config.encoder.from_hf), config.encoder.native)
    trained = load_pool_state(job.final_checkpoint(), "encoder")
    held = "deepstack_mergers." if config.llm.deepstack_levels == 0 else ()  # unless the LLM reads them
    for name, value in pretrained.items():
        assert torch.equal(trained[name], value) == name.startswith(held), name
    if config.eval.final:
        [evaluation] = job.evaluations
        loss, _ = heldout_loss(config, dataset, *load_trained(config, job.final_checkpoint()))
        assert evaluation["loss"] == pytest.approx(loss, rel=TOLERANCE)
    if layout == "whole-enc-tp2-llm-dp2":
        _check_export(config, dataset, job, tmp_path / "exported")


def _check_export(config, dataset, job, out):
    """`dyad export --to-hf` writes the trained whole model: `dyad.hf.load` of the directory holds
    every tensor of the final checkpoint, bit for bit, and transformers' class of it computes
    dyad's logits on a batch of the run's conversations and images."""
    with pytest.raises(SystemExit) as exited:
        main(["export", config.out_dir, "--to-hf", str(out)])
    assert exited.value.code == 0
    ours = dyad.hf.load(out).eval()
    for pool, model in (("encoder", ours.encoder), ("llm", ours.llm)):
        trained = load_pool_state(job.final_checkpoint(), pool)
        state = model.state_dict()
        assert state.keys() == trained.keys(), pool
        for name, tensor in trained.items():
            assert torch.equal(state[name], tensor), f"{pool}.{name}"
    planner = StepPlanner(config, dataset)
    # one image a sample: transformers' positions take two images side by side as one (dyad's data
    # puts no text between them, a processor's template would)
    samples = [dataset.sample(s) for s in dataset.train_ids if len(dataset.sample(s).image_ids) == 1][:3]
    batch = collate(dataset.tokenizer, samples, planner.image_tokens)
    pixel_values, image_grid_thw = dataset.patches(batch.image_ids, image_processor(config.encoder))
    real_BS = torch.arange(batch.input_ids.shape[1]) < batch.lengths[:, None]
    inputs = {"input_ids": batch.input_ids, "attention_mask": real_BS.long(), "pixel_values": pixel_values,
              "image_grid_thw": image_grid_thw, "mm_token_type_ids": (batch.input_ids == dataset.tokenizer.image_id).long()}
    theirs = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(theirs).__name__ == "Qwen3VLMoeForConditionalGeneration"
    with torch.no_grad():
        expected, got = theirs(**inputs).logits, ours(**inputs).logits
    torch.testing.assert_close(got[real_BS], expected[real_BS], rtol=1e-5, atol=1e-5)
