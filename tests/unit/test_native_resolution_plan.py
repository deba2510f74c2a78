"""A run whose encoder is a native-resolution tower (`encoder.from_hf` at a Qwen3-VL-MoE) plans
each image with its own number of tokens: the checkpoint processor's for the image's stored size.
The router's plan, the single-process reference's batches and the LLM workers' (built from the
step command alone) hold the same sequences; the dry run says what it plans; a config whose parts
do not fit together is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from dyad import config as config_lib
from dyad.app.dry_run import describe
from dyad.data import make_dataset
from dyad.data.batch import collate
from dyad.encoder_service.hf_config import image_processor
from dyad.llm_service.worker import planned_image_tokens
from dyad.router.steps import StepPlanner, step_command
from tests.helpers.native_images import OUT, TOKENS, native_conversations, qwen3_vl_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers writes the tiny checkpoint's config")


def _config(tmp_path, *overrides, whole=True):
    checkpoint = tmp_path / "qwen3-vl"
    if not checkpoint.exists():
        qwen3_vl_checkpoint(checkpoint, whole=whole, weights=False)
        native_conversations(tmp_path)
    config = config_lib.load(None, [
        "data.name=conversations", f"data.path={tmp_path / 'conversations.jsonl'}",
        f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}", "data.channels=3", f"encoder.from_hf={checkpoint}",
        "train.global_batch=8", "train.microbatches=2", "parallel.encoder.dp=2", "parallel.llm.dp=2", *overrides,
    ])
    dataset = make_dataset(config.data)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset


def test_each_image_is_planned_with_the_processors_tokens_and_every_side_builds_the_same_sequences(tmp_path):
    config, dataset = _config(tmp_path)
    assert (config.encoder.native.depth, config.encoder.native.out_dim, config.encoder.out_dim) == (2, OUT, OUT)
    processor = image_processor(config.encoder)
    planner = StepPlanner(config, dataset)
    seen = set()
    for step in range(2):
        spec = planner.next(step)
        plan = planner.boundary_plan(spec)
        command = step_command(spec, plan)
        for index, sample_ids in enumerate(spec.microbatches):
            samples = [dataset.sample(s) for s in sample_ids]
            # the router's and the reference's batch, and the LLM worker's from the command alone
            ours = collate(dataset.tokenizer, samples, planner.image_tokens)
            workers = collate(dataset.tokenizer, samples, planned_image_tokens(command.plan, index))
            for field in ("input_ids", "targets", "image_positions", "lengths"):
                assert torch.equal(getattr(ours, field), getattr(workers, field)), field
            _, grid_thw_N3 = dataset.patches(ours.image_ids, processor)  # transformers' grids (test_native_images)
            tokens = (grid_thw_N3.prod(1) // 2**2).tolist()
            assert [planner.image_tokens(i) for i in ours.image_ids] == tokens
            assert ours.image_positions.numel() == sum(tokens)
            assert ours.lengths.tolist() == [dataset.shape(s, planner.image_tokens).seq_len for s in sample_ids]
            work = [w for w in command.plan.encoder_work if w.microbatch == index]
            assert sum(w.rows for w in work) == sum(tokens) == sum(sum(w.image_tokens) for w in work)
            assert sum(r.rows for r in plan.local_rows if r.microbatch == index) == sum(tokens)
            seen |= set(tokens)
    assert seen == set(TOKENS)  # four sizes, four counts


def test_a_tower_alone_resolves_as_the_whole_models(tmp_path):
    whole, _ = _config(tmp_path / "whole")
    alone, _ = _config(tmp_path / "alone", whole=False)
    assert whole.encoder.native == alone.encoder.native


def test_the_dry_run_says_how_many_tokens_the_images_give(tmp_path):
    config, dataset = _config(tmp_path)
    report = describe(config, dataset, "run.yaml")
    assert "native resolution: 4 to 54 tokens per image in step 0; its DeepStack mergers held" in report
    assert "image tokens in flight per encoder rank" in report


@pytest.mark.parametrize(("override", "message"), [
    ("llm.dim=32", r"llm.dim \(32\) must be the out_hidden_size of encoder.from_hf's tower \(64\)"),
    ("data.channels=1", r"data.channels \(1\) must be the tower's \(3, encoder.from_hf\)"),
    ("encoder.native.depth=3", r"encoder.native=.* contradicts encoder.from_hf's tower"),
])
def test_a_config_that_does_not_fit_the_tower_is_refused_naming_the_field(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, override)


def test_a_native_tower_needs_its_processor_and_image_files(tmp_path):
    _config(tmp_path)
    processor = tmp_path / "qwen3-vl" / "preprocessor_config.json"
    processor.write_text(processor.read_text().replace('"patch_size": 4', '"patch_size": 8'))
    with pytest.raises(ValueError, match=r"preprocessor_config.json patch_size=8 is not the tower's \(4, config.json\)"):
        _config(tmp_path)
    processor.unlink()
    with pytest.raises(ValueError, match="needs the preprocessor_config.json of a native-resolution processor"):
        _config(tmp_path)
    config = config_lib.load(None, ["data.channels=3", f"encoder.from_hf={tmp_path / 'qwen3-vl'}"])
    with pytest.raises(ValueError, match=r"data.name \('digits'\) must be one of \('jsonl', 'conversations'\)"):
        config_lib.resolve(config, vocab_size=32)
    config = config_lib.load(None, ["encoder.native.depth=2"])
    with pytest.raises(ValueError, match="encoder.native is resolved from encoder.from_hf"):
        config_lib.resolve(config, vocab_size=32)


def test_qwen3_vl_s_own_llm_is_refused_until_a_run_passes_its_rotary_positions(tmp_path):
    """Its image tokens would train at plain positions, not at the checkpoint's multimodal ones
    (llm.from_hf at a Qwen3-VL sets llm.mrope_section, as here by hand)."""
    config, dataset = _config(tmp_path, "llm.mrope_section=[4,2,2]")  # it loads (tests/dist/test_pretrained_pieces.py)
    with pytest.raises(ValueError, match=r"llm.mrope_section \(\[4, 2, 2\], .* not yet passed by a run's step"):
        StepPlanner(config, dataset)  # the router's and the reference's
