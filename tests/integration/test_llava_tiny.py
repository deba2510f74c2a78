"""The bundled LLaVA-format fixture trains end to end as a user runs it: `dyad train --config
llava-tiny` from the repository's root, pointed at a tiny random Qwen3-VL-MoE that transformers
writes with its tokenizer, chat template and image processor. The run succeeds under encoder dp1
-> LLM dp2·ep2; its loss is finite and falls; every step's tokens are the chat template's text and
the image processor's tokens of that step's samples, and its targets the assistant turns' tokens
and the end of each turn, nothing else; checkpoints, the held-out evaluation and the run's files
are written."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers.conversations import WORDS, tokenizer_dir
from tests.helpers.native_images import PROCESSOR, qwen3_vl_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers writes the checkpoint (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "llava-tiny" / "llava.json"
STEPS = 12  # the config's train.steps


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


def test_the_llava_fixture_trains_end_to_end(tmp_path):
    records = json.loads(FIXTURE.read_text())
    checkpoint = _checkpoint(tmp_path / "qwen3-vl-moe", records)
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", "from dyad.app.cli import main; main()", "train", "--config", "llava-tiny",
         "--set", f"encoder.from_hf={checkpoint}", "--set", f"llm.from_hf={checkpoint}",
         "--set", f"data.tokenizer={checkpoint / 'tokenizer.json'}", "--device", "cpu", "--out", str(out), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
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
