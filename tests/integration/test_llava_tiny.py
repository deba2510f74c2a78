"""The bundled LLaVA-format fixture trains end to end as a user runs it: `dyad train --config
llava-tiny` from the repository's root, pointed at a tiny random Qwen3-VL-MoE that transformers
writes with its tokenizer, chat template and image processor, its samples packed into rows. The
run succeeds under encoder dp1 -> LLM dp2·ep2; its loss is finite and falls; every step's tokens
are the chat template's text and the image processor's tokens of that step's samples, and its
targets the assistant turns' tokens and the end of each turn, nothing else; checkpoints, the
held-out evaluation and the run's files are written. The same run with its encoder pool resized
and an LLM worker killed and recovered from a checkpoint half way through an epoch trains as the
uninterrupted one: the same losses, samples and final parameters, every epoch each training
record once."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from dyad import config as config_lib
from dyad.checkpoint import load_pool_state
from dyad.data import make_dataset
from dyad.router.checkpoints import checkpoint_dir
from dyad.router.steps import StepPlanner
from dyad.wire import pb
from tests.helpers.conversations import WORDS, tokenizer_dir
from tests.helpers.native_images import PROCESSOR, qwen3_vl_checkpoint
from tests.helpers.resilience import BASE, assert_losses_match, in_process_router, kill, run_followed, trained_samples

transformers = pytest.importorskip("transformers", reason="transformers writes the checkpoint (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "llava-tiny" / "llava.json"
STEPS = 12  # the config's train.steps
SEQ_LEN = 64  # packed rows: a microbatch's two samples (23 to 60 tokens) share one where they fit


def _fixture_words(records) -> list[str]:
    """The words of every turn, as the tokenizer's pre-tokenizer splits them."""
    from tokenizers.pre_tokenizers import Whitespace

    words = set()
    for record in records:
        for turn in record["conversations"]:
            words |= {word for word, _ in Whitespace().pre_tokenize_str(turn["value"].replace("<image>", " "))}
    return sorted(words)


def _checkpoint(path, records):
    """A tiny random Qwen3-VL-MoE directory as the hub has one: weights, preprocessor_config.json,
    tokenizer.json of the fixture's words and the chat template in tokenizer_config.json."""
    words = sorted(set(WORDS) | set(_fixture_words(records)))
    tokenizer_dir(path, words=words, eos="<|im_end|>")
    qwen3_vl_checkpoint(path, vocab_size=128)
    return path


def _expected_counts(checkpoint, records) -> list[tuple[int, int]]:
    """(sequence tokens, target tokens) of each record, from transformers' tokenizer, chat
    template and image processor: the rendered text's tokens, each <image> replaced by the
    processor's tokens of its image (its patches after the 2x2 merge); the targets, each assistant
    turn's tokens and the <|im_end|> that closes it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    processor = transformers.Qwen2VLImageProcessor(**PROCESSOR)
    counts = []
    for record in records:
        roles = {"human": "user", "gpt": "assistant"}
        messages = [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        n_text = len(tokenizer(text.replace("<image>", " "), add_special_tokens=False).input_ids)
        n_image = 0
        if "image" in record:
            image = Image.open(FIXTURE.parent / record["image"]).convert("RGB")
            n_image = int(processor(images=[image], return_tensors="pt").image_grid_thw.prod()) // 4
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        n_targets = sum(len(tokenizer(a, add_special_tokens=False).input_ids) + 1 for a in answers)
        counts.append((n_text + n_image, n_targets))
    return counts


def _sets(checkpoint) -> list[str]:
    """The tiny checkpoint as the run's model and tokenizer, its samples packed."""
    return [f"encoder.from_hf={checkpoint}", f"llm.from_hf={checkpoint}",
            f"data.tokenizer={checkpoint / 'tokenizer.json'}", f"train.seq_len={SEQ_LEN}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The uninterrupted run, as a user runs it: (its checkpoint, the records, its out_dir)."""
    root = tmp_path_factory.mktemp("llava-tiny")
    records = json.loads(FIXTURE.read_text())
    checkpoint = _checkpoint(root / "qwen3-vl-moe", records)
    out = root / "run"
    sets = [arg for assignment in _sets(checkpoint) for arg in ("--set", assignment)]
    result = subprocess.run(
        [sys.executable, "-c", "from dyad.app.cli import main; main()", "train", "--config", "llava-tiny", *sets,
         "--device", "cpu", "--out", str(out), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return checkpoint, records, out


def test_the_llava_fixture_trains_end_to_end(trained):
    checkpoint, records, out = trained
    config = (out / "config.yaml").read_text()
    assert "deepstack_levels: 1" in config and "mrope_section:" in config, config  # the whole model crossed

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == list(range(STEPS))
    losses = [m["loss"] for m in steps]
    assert all(math.isfinite(loss) for loss in losses), losses
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses

    counts = _expected_counts(checkpoint, records)
    trained = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(STEPS))
    for step, samples in zip(steps, trained):
        assert step["tokens"] == sum(counts[s][0] for s in samples["samples"]), step
        assert step["target_tokens"] == sum(counts[s][1] for s in samples["samples"]), step
    heldout = sorted(set(range(len(records))) - {s for t in trained for s in t["samples"]})
    [evaluation] = [m for m in metrics if "eval_loss" in m]
    assert len(heldout) == 4 and evaluation["eval_target_tokens"] == sum(counts[s][1] for s in heldout)
    assert evaluation["eval_loss"] < losses[0], evaluation

    committed = [m["step"] for m in metrics if m.get("event") == "checkpoint"]
    assert committed == [6, 12], metrics
    for step in committed:
        manifest = out / "checkpoints" / f"step_{step:08d}" / "manifest.json"
        assert json.loads(manifest.read_text())["step"] == step
    assert (out / "loss.png").stat().st_size > 0 and any((out / "tensorboard").iterdir())


# The recovery's checkpoint: after an odd step, so the sampler's cursor stands half way through an
# epoch (16 training records, 8 a step: two steps an epoch), and the steps trained again cross
# into the next one.
CHECKPOINT_STEP = 7


def _epochs(trained_by_step: dict[int, list[int]], train_ids: list[int]) -> list[list[int]]:
    """The samples trained, in step order, cut into epochs of the training split's size, each
    sorted."""
    flat = [s for step in sorted(trained_by_step) for s in trained_by_step[step]]
    return [sorted(flat[start : start + len(train_ids)]) for start in range(0, len(flat), len(train_ids))]


def _losses(out_dir: Path) -> dict[int, pb.StepMetrics]:
    """The loss of each step in a run's metrics.jsonl (its last record: a run's final lineage)."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: pb.StepMetrics(step=r["step"], loss=r["loss"]) for r in records if "loss" in r}


def _assert_same_parameters(checkpoint: Path, expected: Path, pool: str) -> None:
    """Every parameter of `pool` in `checkpoint` is the one in `expected` to fp32 rounding (the
    sums of a resized pool add in another order)."""
    got, want = load_pool_state(checkpoint, pool), load_pool_state(expected, pool)
    assert got.keys() == want.keys(), pool
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"{pool}.{name}")


def test_an_interrupted_run_trains_each_epoch_as_the_uninterrupted_one(tmp_path, trained):
    """The same run on a router in this process, its encoder pool resized 1 -> 2 when step 1 is
    reported (at the next step boundary not already sent ahead) and an LLM worker SIGKILLed when
    step 8 is: the run goes back to step 7's checkpoint (its sampler half way through epoch 3)
    and trains steps 7 and 8 again, across the boundary into epoch 4. Every step's loss and
    samples, and the final checkpoint's parameters, are the uninterrupted run's, and each of its
    6 epochs trains each of the 16 training records exactly once."""
    checkpoint, _, baseline_dir = trained
    config = config_lib.load("llava-tiny", [
        *_sets(checkpoint), f"data.path={FIXTURE}", "train.device=cpu",
        f"checkpoint.interval_steps={CHECKPOINT_STEP}", *[s for s in BASE if s.startswith("router.")],
    ])
    config = dataclasses.replace(config, out_dir=str(tmp_path / "run"))
    dataset = make_dataset(config.data)
    train_ids = sorted(dataset.train_ids)
    planned = StepPlanner(config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset)
    rows = {size for step in range(STEPS) for sizes in planned.next(step).row_sizes for size in sizes}
    assert rows == {1, 2}, rows  # packing is on: some rows hold both of a microbatch's samples, some one
    killed = []

    with in_process_router() as (client, state):
        def resize_then_kill(metrics):
            run_id = state.active_run_ids()[0]
            if metrics.step == 1 and state.get(run_id).pool_sizes["encoder"] == 1:
                client.scale_pool(run_id, "encoder", 2)
            if metrics.step == CHECKPOINT_STEP + 1 and not killed:
                killed.append(state.get(run_id).pids["llm/1"])
                kill(killed[0])

        run = run_followed(client, config, resize_then_kill)
    assert killed
    assert run.info.state == pb.RUN_STATE_SUCCEEDED, run.info.message
    assert [n.message.split(" in ")[0] for n in run.notices if n.kind == "resize"] == ["encoder 1 -> 2"], run.notices
    assert [n.step for n in run.notices if n.kind == "recovery"] == [CHECKPOINT_STEP], run.notices
    assert run.info.recoveries == 1 and run.info.encoder_replicas == 2

    assert_losses_match(run.steps, _losses(baseline_dir))

    out = Path(config.out_dir)
    attempts = [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
    repeated = sorted({step for step in attempts if attempts.count(step) > 1})
    assert repeated[:2] == [CHECKPOINT_STEP, CHECKPOINT_STEP + 1], attempts  # (a third if the kill came late)
    samples = trained_samples(out)
    assert samples == trained_samples(baseline_dir)
    assert _epochs(samples, train_ids) == [train_ids] * (STEPS * config.train.global_batch // len(train_ids))

    for pool in ("encoder", "llm"):
        _assert_same_parameters(checkpoint_dir(out, STEPS), checkpoint_dir(baseline_dir, STEPS), pool)
