"""A run whose LLM starts from a Hugging Face checkpoint (`llm.from_hf`): a tiny random Qwen3-MoE
saved by transformers, with a tokenizer.json beside it, fine-tuned for 30 steps with a new
encoder. Its first step's loss is transformers' loss on the same batch (the encoder's rows spliced
into transformers' input embeddings); the loss then falls. A tokenizer with more ids than the
embedding grows it and says so; a run config contradicting the checkpoint is refused naming the
field; a fine-tuned LLM exports to a directory transformers loads (`dyad export --to-hf`), and so
does a fine-tuned LLaVA-style whole (as transformers' `LlavaForConditionalGeneration`); a run from a
LLaVA directory starts at transformers' LLaVA's loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import dyad.hf
from dyad import config as config_lib
from dyad.app.cli import main
from dyad.app.verify import compare_with_reference
from dyad.checkpoint import load_pool_state
from dyad.data import FixedTokens, make_dataset
from dyad.data.batch import collate
from dyad.encoder_service.hf import encoder_state_dict, tower_prefix
from dyad.encoder_service.step import encode_rows
from dyad.hf_checkpoint import HFCheckpoint
from dyad.llm_service.hf import llm_state_dict
from dyad.router.checkpoints import checkpoint_dir
from dyad.router.steps import StepPlanner
from dyad.service import build_model
from dyad.wire import pb
from tests.helpers.hf_models import digits_tokenizer_in, make_norms_and_biases_matter
from tests.helpers.resilience import BASE, in_process_router, run_followed, run_in_process

transformers = pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e '.[test]')")

RUN = """
data: {name: digits, image_size: 16, channels: 1, tokenizer: TOKENIZER}
encoder: {patch_size: 4, dim: 64, depth: 2, heads: 4}
llm: {from_hf: CHECKPOINT}
train: {lr: 0.002, warmup_steps: 3}
eval: {final: false}
"""


def _checkpoint(path, extra_tokens: int = 0):
    """A tiny Qwen3-MoE over the digits' word tokenizer (whose ids it shares), saved with its
    tokenizer.json; `extra_tokens` fewer embedding rows than the tokenizer has ids."""
    tokenizer = digits_tokenizer_in(path)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=tokenizer.vocab_size - extra_tokens, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=256,
        router_aux_loss_coef=0.0, tie_word_embeddings=False,
    )).float().eval()
    model.save_pretrained(path)
    return model


def _config(tmp_path, checkpoint, *overrides):
    path = tmp_path / "run.yaml"
    path.write_text(RUN.replace("TOKENIZER", str(checkpoint / "tokenizer.json")).replace("CHECKPOINT", str(checkpoint)))
    config = config_lib.load(path, [*BASE, "checkpoint.interval_steps=0", *overrides])
    return dataclasses.replace(config, out_dir=str(tmp_path / "out"))


@torch.no_grad()
def _transformers_loss(reference, config, step: int = 0) -> float:
    """Step `step`'s caption loss by transformers' model, the run's initial encoder's rows in its
    input embeddings, normalised as dyad normalises (by the global batch's caption tokens)."""
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    planner = StepPlanner(resolved, dataset)
    spec = [planner.next(s) for s in range(step + 1)][-1]
    encoder = build_model(resolved, "encoder", device="cpu")
    total = 0.0
    for sample_ids in spec.microbatches:
        batch = collate(dataset.tokenizer, [dataset.sample(s) for s in sample_ids], FixedTokens(resolved.encoder.tokens_per_image))
        embeds_BSD = reference.model.embed_tokens(batch.input_ids)
        B, S, D = embeds_BSD.shape
        embeds_BSD = embeds_BSD.reshape(B * S, D).index_put(
            (batch.image_positions,), encode_rows(encoder, dataset, batch.image_ids, "cpu")
        ).view(B, S, D)
        attention_mask = (torch.arange(S) < batch.lengths[:, None]).long()
        logits = reference(inputs_embeds=embeds_BSD, attention_mask=attention_mask).logits
        total += float(F.cross_entropy(logits.reshape(B * S, -1), batch.targets.reshape(-1), reduction="sum"))
    return total / spec.target_tokens


def test_a_pretrained_llm_fine_tunes_from_where_transformers_starts(tmp_path):
    reference = _checkpoint(tmp_path / "qwen3-moe")
    config = _config(tmp_path, tmp_path / "qwen3-moe", "train.steps=30")
    with in_process_router() as (client, _):
        run = run_followed(client, config)
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    assert run.steps[0].lm_loss == pytest.approx(_transformers_loss(reference, config), rel=1e-5)
    assert run.steps[29].lm_loss < run.steps[0].lm_loss / 2
    assert not [n for n in run.notices if n.kind == "warning"]  # the tokenizer fits the embedding


def test_a_tokenizer_with_more_ids_grows_the_embedding_and_says_so(tmp_path):
    _checkpoint(tmp_path / "qwen3-moe", extra_tokens=2)
    config = _config(tmp_path, tmp_path / "qwen3-moe", "train.steps=2")
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    assert resolved.llm.vocab_size == dataset.tokenizer.vocab_size
    assert (resolved.llm.dim, resolved.llm.head_dim, resolved.llm.dense_layers) == (64, 16, (0,))
    with in_process_router() as (client, _):
        run = run_followed(client, config)
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    [warning] = [n for n in run.notices if n.kind == "warning"]
    assert warning.message.startswith("the tokenizer has 2 more ids than ")
    assert f"grow to {dataset.tokenizer.vocab_size} rows" in warning.message


def test_a_run_config_contradicting_the_checkpoint_is_refused_naming_the_field(tmp_path):
    _checkpoint(tmp_path / "qwen3-moe")
    dataset_size = make_dataset(config_lib.load(None, []).data).tokenizer.vocab_size
    for override, field in (("llm.dim=128", "llm.dim=128"), ("llm.moe.num_experts=8", "llm.moe.num_experts=8")):
        config = _config(tmp_path, tmp_path / "qwen3-moe", override)
        with pytest.raises(ValueError, match=f"{field} contradicts llm.from_hf's checkpoint"):
            config_lib.resolve(config, vocab_size=dataset_size)
    config = _config(tmp_path, tmp_path / "qwen3-moe", "data.tokenizer=null")
    with pytest.raises(ValueError, match="llm.from_hf needs data.tokenizer"):
        config_lib.resolve(config, vocab_size=dataset_size)
    config = _config(tmp_path, tmp_path / "qwen3-moe", f"llm.from_hf={tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match="llm.from_hf: .*nowhere has no config.json"):
        config_lib.resolve(config, vocab_size=dataset_size)


def test_a_fine_tuned_llm_exports_to_a_directory_transformers_loads(tmp_path, capsys):
    """Trained under tp2·ep2, written back in the checkpoint's own format: every tensor is the
    checkpoint's, bit for bit, and transformers' model of the directory computes dyad's logits."""
    _checkpoint(tmp_path / "qwen3-moe")
    config = _config(tmp_path, tmp_path / "qwen3-moe", "train.steps=2", "parallel.llm.tp=2", "parallel.llm.ep=2")
    with in_process_router() as (client, _):
        run = run_followed(client, config)
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    out = tmp_path / "exported"
    with pytest.raises(SystemExit) as exited:
        main(["export", config.out_dir, "--to-hf", str(out)])
    assert exited.value.code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip().endswith(f"the LLM written to {out} (1 safetensors file)")

    trained = load_pool_state(checkpoint_dir(config.out_dir, 2), "llm")
    cfg = config_lib.load(tmp_path / "out" / "config.yaml", []).llm
    for name, tensor in llm_state_dict(HFCheckpoint(out), cfg).items():
        assert torch.equal(tensor, trained[name]), name
    before = load_file(tmp_path / "qwen3-moe" / "model.safetensors")["model.layers.1.mlp.experts.0.down_proj.weight"]
    assert before.T.shape == trained["layers.1.feed_forward.w2_EFD"][0].shape
    assert not torch.equal(trained["layers.1.feed_forward.w2_EFD"][0], before.T)  # trained: these are new weights

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    input_ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reloaded(input_ids=input_ids).logits
        got = dyad.hf.load(out)(input_ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(SystemExit) as exited:  # never over what is there
        main(["export", config.out_dir, "--to-hf", str(out)])
    assert exited.value.code == 2 and "exists and is not empty" in capsys.readouterr().err


LLAVA_RUN = """
data: {name: digits, image_size: 16, channels: 3, tokenizer: TOKENIZER}
encoder: {from_hf: TOWER, feature_layer: -2}
llm: {from_hf: CHECKPOINT}
train: {lr: 0.002, warmup_steps: 3}
eval: {final: false}
"""


def _tower(path):
    torch.manual_seed(1)
    tower = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=16,
        patch_size=4, num_channels=3, vision_use_head=False,
    )).float().eval()
    tower.save_pretrained(path)
    return tower


@torch.no_grad()
def _llava_loss(tower, llm, config) -> float:
    """Step 0's caption loss of the LLaVA-style whole in transformers' modules: the tower's
    hidden states of the feature layer, the run's initial projector (dyad's: seeded), spliced into
    the LLM's input embeddings."""
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    spec = StepPlanner(resolved, dataset).next(0)
    projector = build_model(resolved, "encoder", device="cpu")
    total = 0.0
    for sample_ids in spec.microbatches:
        batch = collate(dataset.tokenizer, [dataset.sample(s) for s in sample_ids], FixedTokens(resolved.encoder.tokens_per_image))
        pixels = dataset.images(list(batch.image_ids), device="cpu")
        features = tower(pixel_values=pixels, output_hidden_states=True).hidden_states[resolved.encoder.feature_layer]
        rows = projector.proj_out(F.gelu(projector.proj_in(features))).flatten(0, 1)
        embeds_BSD = llm.model.embed_tokens(batch.input_ids)
        B, S, D = embeds_BSD.shape
        embeds_BSD = embeds_BSD.reshape(B * S, D).index_put((batch.image_positions,), rows).view(B, S, D)
        attention_mask = (torch.arange(S) < batch.lengths[:, None]).long()
        logits = llm(inputs_embeds=embeds_BSD, attention_mask=attention_mask).logits
        total += float(F.cross_entropy(logits.reshape(B * S, -1), batch.targets.reshape(-1), reduction="sum"))
    return total / spec.target_tokens


def test_a_llava_style_whole_from_a_tower_and_an_llm_trains_across_the_pools_as_on_one_device(tmp_path):
    """A SigLIP tower (to its penultimate block) and a Qwen3-MoE, joined by a new projector:
    step 0 is transformers' loss of the same whole, and encoder dp2 -> LLM tp2·ep2 reproduces the
    single-process reference (`dyad verify`'s comparison) step by step."""
    tower, llm = _tower(tmp_path / "siglip"), _checkpoint(tmp_path / "qwen3-moe")
    path = tmp_path / "run.yaml"
    path.write_text(LLAVA_RUN.replace("TOKENIZER", str(tmp_path / "qwen3-moe" / "tokenizer.json"))
                    .replace("TOWER", str(tmp_path / "siglip")).replace("CHECKPOINT", str(tmp_path / "qwen3-moe")))
    config = config_lib.load(path, [
        *BASE, "checkpoint.interval_steps=0", "train.steps=4", "parallel.encoder.dp=2", "parallel.llm.tp=2",
        "parallel.llm.ep=2",
    ])
    config = dataclasses.replace(config, out_dir=str(tmp_path / "out"))
    job = run_in_process(config)
    assert job.succeeded, job.info.message
    assert job.metrics[0]["lm_loss"] == pytest.approx(_llava_loss(tower, llm, config), rel=1e-5)
    dataset = make_dataset(config.data)
    comparison = compare_with_reference(config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size),
                                        dataset, job)
    assert comparison.worst_loss_error <= 1e-5, comparison.losses
    assert comparison.worst_param_error <= 1e-5, (comparison.worst_param, comparison.worst_param_error)

    out = tmp_path / "exported"
    with pytest.raises(SystemExit) as exited:
        main(["export", config.out_dir, "--to-hf", str(out)])
    assert exited.value.code == 0
    _check_llava_export(out, checkpoint_dir(config.out_dir, 4), config_lib.load(tmp_path / "out" / "config.yaml", []),
                        tmp_path / "siglip")


def _check_llava_export(out, checkpoint, config, tower_source):
    """The export holds the trained encoder (its projector LLaVA's) and LLM bit for bit, and the
    source tower's blocks past the feature layer; transformers' LLaVA of it computes dyad's logits."""
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    exported = HFCheckpoint(out)
    for pool, read in (("encoder", encoder_state_dict), ("llm", llm_state_dict)):
        trained = load_pool_state(checkpoint, pool)
        for name, tensor in read(exported, getattr(resolved, pool)).items():
            assert torch.equal(tensor, trained[name]), name
    unused = "encoder.layers.2.mlp.fc2.weight"  # the last block's: LLaVA takes the penultimate's output
    source = HFCheckpoint(tower_source)
    assert torch.equal(exported.stored(f"vision_tower.vision_model.{unused}", (32, 48)).full(),
                       source.stored(tower_prefix(source) + unused, (32, 48)).full())
    reloaded = transformers.LlavaForConditionalGeneration.from_pretrained(out).eval()
    batch = collate(dataset.tokenizer, [dataset.sample(s) for s in dataset.train_ids[:3]], FixedTokens(resolved.encoder.tokens_per_image))
    attention_mask = (torch.arange(batch.input_ids.shape[1]) < batch.lengths[:, None]).long()
    inputs = dict(input_ids=batch.input_ids, pixel_values=dataset.images(list(batch.image_ids), device="cpu"),
                  attention_mask=attention_mask)
    with torch.no_grad():
        expected, got = reloaded(**inputs).logits, dyad.hf.load(out)(**inputs).logits
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-6)


def _llava_directory(path):
    """A tiny LLaVA (SigLIP, its projector, a Qwen3-MoE over the digits' word tokenizer, whose
    `<image>` is its image placeholder), saved with the tokenizer.json beside it."""
    tokenizer = digits_tokenizer_in(path)
    torch.manual_seed(2)
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=16,
            patch_size=4, num_channels=3, vision_use_head=False),
        text_config=transformers.Qwen3MoeConfig(
            vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=256, router_aux_loss_coef=0.0,
            tie_word_embeddings=False),
        image_token_index=tokenizer.image_id, vision_feature_layer=-2, vision_feature_select_strategy="full",
        tie_word_embeddings=False,
    )).float().eval()
    make_norms_and_biases_matter(model, bias_std=0.2)
    model.save_pretrained(path)
    return model


@torch.no_grad()
def _transformers_llava_loss(reference, config) -> float:
    """Step 0's caption loss of transformers' LLaVA on the run's batch (token ids with `<image>`
    placeholders, the images' pixels), normalised as dyad normalises."""
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    spec = StepPlanner(resolved, dataset).next(0)
    total = 0.0
    for sample_ids in spec.microbatches:
        batch = collate(dataset.tokenizer, [dataset.sample(s) for s in sample_ids], FixedTokens(resolved.encoder.tokens_per_image))
        attention_mask = (torch.arange(batch.input_ids.shape[1]) < batch.lengths[:, None]).long()
        logits = reference(input_ids=batch.input_ids, attention_mask=attention_mask,
                           pixel_values=dataset.images(list(batch.image_ids), device="cpu")).logits
        total += float(F.cross_entropy(logits.flatten(0, 1), batch.targets.reshape(-1), reduction="sum"))
    return total / spec.target_tokens


def test_a_run_from_a_llava_directory_starts_at_transformers_loss_and_trains_as_on_one_device(tmp_path):
    """Both pools from one LLaVA directory (the tower and its projector, the LLM) under encoder tp2
    -> LLM cp2: step 0 is transformers' LLaVA's loss on the same batch, every step matches the
    single-process reference (`dyad verify`'s comparison), whose initial weights are
    `dyad.hf.load`'s of the directory."""
    llava = _llava_directory(tmp_path / "llava")
    path = tmp_path / "run.yaml"
    path.write_text(LLAVA_RUN.replace("TOKENIZER", str(tmp_path / "llava" / "tokenizer.json"))
                    .replace("TOWER", str(tmp_path / "llava")).replace("CHECKPOINT", str(tmp_path / "llava")))
    config = config_lib.load(path, [
        *BASE, "checkpoint.interval_steps=0", "train.steps=3", "parallel.encoder.tp=2", "parallel.llm.cp=2",
    ])
    config = dataclasses.replace(config, out_dir=str(tmp_path / "out"))
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    loaded = dyad.hf.load(tmp_path / "llava")
    for pool, part in (("encoder", loaded.encoder), ("llm", loaded.llm)):
        reference_state = build_model(resolved, pool, device="cpu").state_dict()
        for name, tensor in part.state_dict().items():
            assert torch.equal(reference_state[name], tensor), f"{pool}.{name}"

    job = run_in_process(config)
    assert job.succeeded, job.info.message
    assert job.metrics[0]["lm_loss"] == pytest.approx(_transformers_llava_loss(llava, config), rel=1e-5)
    comparison = compare_with_reference(resolved, dataset, job)
    assert comparison.worst_loss_error <= 1e-5, comparison.losses
    assert comparison.worst_param_error <= 1e-5, (comparison.worst_param, comparison.worst_param_error)
