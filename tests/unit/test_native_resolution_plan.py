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
from dyad.data import FixedTokens, make_dataset
from dyad.data.batch import collate
from dyad.encoder_service.hf_config import image_processor
from dyad.llm_service.rope_index import batch_rope_positions, rope_index
from dyad.llm_service.sharding import shard_microbatch
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
            merged = [(t, h // 2, w // 2) for t, h, w in grid_thw_N3.tolist()]  # each image's grid of tokens
            assert list(ours.image_grids) == list(workers.image_grids) == merged
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
    ("llm.deepstack_levels=2", r"llm.deepstack_levels \(2\) must be 0 or the number of encoder.from_hf's DeepStack"),
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


def test_the_llm_ranks_rotary_positions_are_transformers_of_the_same_tokens_and_grids(tmp_path):
    """With Qwen3-VL's multimodal rotary (llm.mrope_section, as llm.from_hf at a Qwen3-VL sets it),
    every LLM rank computes its columns' (t, h, w) positions from the batch the step command
    gives it: the whole microbatch's are `rope_index` (transformers' get_rope_index,
    tests/unit/test_hf_qwen3_vl_moe.py) of its image tokens and the processor's patch grids, and
    a context-parallel shard holds its columns of them."""
    config, dataset = _config(tmp_path, "llm.mrope_section=[4,2,2]", "llm.n_heads=4", "llm.n_kv_heads=2")
    processor = image_processor(config.encoder)
    planner = StepPlanner(config, dataset)
    spec = planner.next(0)
    command = step_command(spec, planner.boundary_plan(spec))
    for index, sample_ids in enumerate(spec.microbatches):
        batch = collate(dataset.tokenizer, [dataset.sample(s) for s in sample_ids],
                        planned_image_tokens(command.plan, index))
        S = batch.input_ids.shape[1]
        _, grid_thw_N3 = dataset.patches(batch.image_ids, processor)
        positions_3BS = batch_rope_positions(batch)
        first = 0  # the sample's first image among the batch's
        for b, sample_id in enumerate(sample_ids):
            images = len(dataset.sample(sample_id).image_ids)
            types_1S = torch.zeros(1, S, dtype=torch.long)
            rows = sum(int(grid_thw_N3[i].prod()) // 4 for i in range(first, first + images))
            taken = batch.image_positions[(batch.image_positions // S) == b][:rows] % S
            types_1S[0, taken] = 1
            if images == 2 and taken.diff().max() == 1:  # side by side: the second starts where the first ends
                _, h, w = (grid_thw_N3[first] // torch.tensor([1, 2, 2])).tolist()
                types_1S[0, taken[h * w :]] = 0  # the first image alone
                one = rope_index(types_1S, grid_thw_N3[first : first + 1], None, spatial_merge_size=2)
                assert torch.equal(positions_3BS[:, b, : taken[h * w]], one[:, 0, : taken[h * w]])
                assert torch.equal(positions_3BS[:, b, taken[h * w]], one[:, 0, taken[h * w - 1]] - torch.tensor(
                    [0, h - 1, w - 1]) + max(h, w))  # the second image's first token
            else:
                real_1S = torch.arange(S).unsqueeze(0) < batch.lengths[b]
                expected_31S = rope_index(types_1S, grid_thw_N3[first : first + images], real_1S, spatial_merge_size=2)
                assert torch.equal(positions_3BS[:, b : b + 1], expected_31S)
            first += images
        assert positions_3BS[1:].amax() < positions_3BS[0].amax() + S  # sanity: positions stay small
        expected_3BS = positions_3BS
        whole = shard_microbatch(batch, pad_id=0, cp=1, cp_rank=0, tp=1, multimodal_rope=True)
        assert torch.equal(whole.rope_positions_3BSl, expected_3BS)
        for cp_rank in range(2):
            shard = shard_microbatch(batch, pad_id=0, cp=2, cp_rank=cp_rank, tp=1, multimodal_rope=True)
            held_S = shard.positions_Sl < S
            expected = expected_3BS[:, :, shard.positions_Sl[held_S]]
            assert torch.equal(shard.rope_positions_3BSl[:, :, held_S], expected)
            assert not shard.rope_positions_3BSl[:, :, ~held_S].any()  # padding past the sequence: 0


def test_a_fixed_resolution_towers_tokens_lie_on_their_square():
    """What multimodal rotary positions take of a fixed-resolution tower's image (its patches'
    square, row-major), and none where its count is not a square."""
    assert FixedTokens(16).token_grid(7) == (1, 4, 4)
    assert FixedTokens(15).token_grid(7) is None
