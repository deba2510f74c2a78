"""Conversation data (`data.name: conversations`): records in both formats and their errors with
file:line; the chat template rendered as transformers' `apply_chat_template` renders it; loss
targets on the assistant turns only; images prepared as transformers' SigLIP and CLIP processors
prepare them; and two reference steps of a tiny Qwen3-MoE on conversations."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from dyad.data import IGNORE_INDEX, DataConfig, DatasetError, FixedTokens, build_sequence, make_dataset, read_image_processor
from dyad.data.chat import load_chat_template
from dyad.data.pixels import prepared_pixels
from dyad.data.tokenizer import load_tokenizer
from tests.helpers.conversations import CHATML, tokenizer_dir, write_images, write_jsonl

transformers = pytest.importorskip("transformers", reason="transformers is the test reference")

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA2 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "<image>\nWhat is this?"}, {"role": "assistant", "content": "A cat."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is this?"},
     {"role": "assistant", "content": " A cat. "}, {"role": "user", "content": "colour?"},
     {"role": "assistant", "content": "Grey."}],
]


@pytest.mark.parametrize("template, bos, eos, jinja_file", [
    (CHATML, "<s>", "<|im_end|>", False), (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", True), (LLAMA2, "<s>", "</s>", False),
])
def test_the_chat_template_renders_as_transformers_apply_chat_template(tmp_path, template, bos, eos, jinja_file):
    path = tokenizer_dir(tmp_path / "tok", template, bos, eos, jinja_file)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    ours = load_chat_template(path, load_tokenizer(path).special_tokens)
    for messages in CONVERSATIONS:
        if template == LLAMA2 and messages[0]["role"] == "system":
            continue
        for prompt in (False, True):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.render(messages, add_generation_prompt=prompt) == expected


def test_assistant_turns_and_their_end_of_turn_tokens_are_the_only_targets(tmp_path):
    tokenizer_path = tokenizer_dir(tmp_path / "tok", CHATML)
    (name,) = write_images(tmp_path, [(5, 7)])
    data = write_jsonl(tmp_path / "c.jsonl", [{"images": [name], "conversations": [
        {"from": "human", "value": "What is this?"}, {"from": "gpt", "value": "A cat."},
        {"from": "human", "value": "colour?"}, {"from": "gpt", "value": "Grey."}]}])
    dataset = make_dataset(DataConfig(name="conversations", path=str(data), tokenizer=str(tokenizer_path),
                                      channels=3, heldout_fraction=0.5))
    sample = dataset.sample(0)
    assert sample.text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<image>\n"
                           "What is this?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\n"
                           "colour?<|im_end|>\n<|im_start|>assistant\nGrey.<|im_end|>\n")
    tok = dataset.tokenizer
    ids, targets, positions = build_sequence(tok, sample, FixedTokens(3))
    expected = [tok.encode(w)[0] for w in ("A", "cat", ".", "<|im_end|>", "Grey", ".", "<|im_end|>")]
    assert [t for t in targets if t != IGNORE_INDEX] == expected
    assert all(t == IGNORE_INDEX or t == ids[i + 1] for i, t in enumerate(targets))
    first = targets.index(expected[0])
    assert tok.decode(ids[: first + 1], skip_special_tokens=False).endswith("<|im_start|> assistant")
    assert len(positions) == 3 and ids[0] == tok.encode("<|im_start|>")[0]  # no bos of dyad's added
    shape = dataset.shape(0, FixedTokens(3))
    assert (shape.seq_len, shape.n_targets) == (len(ids), len(expected))


def test_records_of_both_formats_load_and_bad_ones_are_reported_with_file_and_line(tmp_path):
    tokenizer_path = tokenizer_dir(tmp_path / "tok", LLAMA2)
    names = write_images(tmp_path, [(4, 4), (6, 3)])
    good_openai = {"images": names, "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}, {"type": "image"}]},
        {"role": "assistant", "content": "A cat."}]}
    good_llava = {"images": [names[0]], "conversations": [{"from": "human", "value": "What?"},
                                                          {"from": "gpt", "value": "A cat."}], "split": "heldout"}
    data = write_jsonl(tmp_path / "c.jsonl", [good_openai, good_llava])
    dataset = make_dataset(DataConfig(name="conversations", path=str(data), tokenizer=str(tokenizer_path), channels=3))
    assert dataset.sample(0).text == "<s>[INST] <image>\nWhat is this?\n<image> [/INST] A cat. </s>"
    assert dataset.sample(1).text == "<s>[INST] <image>\nWhat? [/INST] A cat. </s>"  # LLaVA's leading placeholder
    assert dataset.heldout_ids == [1]

    bad = write_jsonl(tmp_path / "bad.jsonl", [
        good_llava,
        "{not json",
        {"images": [], "messages": [{"role": "robot", "content": "hi"}]},
        {"images": names, "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]},
        {"images": ["missing.png"], "messages": [{"role": "user", "content": "<image>"}]},
        {"images": [], "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}]},
        {"images": [], "caption": "a caption"},
        {"messages": [{"role": "assistant", "content": "a"}]},
    ])
    with pytest.raises(DatasetError) as error:
        make_dataset(DataConfig(name="conversations", path=str(bad), tokenizer=str(tokenizer_path), channels=3))
    message = str(error.value)
    for expected in (
        f"{bad}:2: invalid JSON", f"{bad}:3: message 1 must be", f"{bad}:4: 1 <image> placeholders but 2 images",
        f"{bad}:5: no assistant turn with content", f"{bad}:5: image 'missing.png' not found",
        f"{bad}:6: chat template: Conversation roles must alternate",
        f"{bad}:7: a record needs one of 'conversations' (LLaVA) or 'messages' (OpenAI)",
        f"{bad}:8: a record needs 'images': its image paths, [] for none",
    ):
        assert expected in message, message
    assert f"{bad}:1:" not in message


def test_conversations_need_a_tokenizer_with_a_chat_template(tmp_path):
    with pytest.raises(ValueError, match="data.tokenizer is required when data.name is 'conversations'"):
        DataConfig(name="conversations", path="c.jsonl")
    path = tokenizer_dir(tmp_path / "tok", CHATML)
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    data = write_jsonl(tmp_path / "c.jsonl", [{"images": [], "messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(ValueError, match="data.tokenizer: no chat template in"):
        make_dataset(DataConfig(name="conversations", path=str(data), tokenizer=str(path)))


SIGLIP = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 24, "width": 24}, "resample": 3,
          "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
          "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
CLIP = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 20}, "crop_size": {"height": 18, "width": 18},
        "do_center_crop": True, "resample": 3, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_convert_rgb": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711]}


@pytest.mark.parametrize("config, reference", [(SIGLIP, "SiglipImageProcessorPil"), (CLIP, "CLIPImageProcessorPil")])
def test_images_are_prepared_as_transformers_image_processor_prepares_them(tmp_path, config, reference):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    processor = read_image_processor(tmp_path)
    expected_processor = getattr(transformers, reference)(**{k: v for k, v in config.items() if k != "image_processor_type"})
    names = (write_images(tmp_path, [(37, 23), (16, 50), (24, 24)]) + write_images(tmp_path, [(30, 9)], "RGBA")
             + write_images(tmp_path, [(11, 13)], "L"))
    for name in names:
        with Image.open(tmp_path / name) as image:
            ours = prepared_pixels(image, processor)
            expected = expected_processor(image, return_tensors="np")["pixel_values"][0]
        assert ours.dtype == np.float32 and ours.shape == expected.shape
        assert np.abs(ours - expected).max() <= 1e-6, name


def test_a_file_dataset_prepares_its_images_with_the_processor(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(SIGLIP))
    names = write_images(tmp_path, [(37, 23), (16, 50)])
    data = write_jsonl(tmp_path / "d.jsonl", [{"images": names, "caption": "a b"}, {"images": [], "caption": "c"}])
    dataset = make_dataset(DataConfig(name="jsonl", path=str(data), channels=3, image_size=24))
    processor = read_image_processor(tmp_path)
    images_NCHW = dataset.images([0, 1], processor=processor)
    assert images_NCHW.shape == (2, 3, 24, 24)
    with Image.open(tmp_path / names[1]) as image:
        assert torch.equal(images_NCHW[1], torch.from_numpy(prepared_pixels(image, processor)))
    assert dataset.images([0, 1]).min() >= 0  # without a processor: today's [0, 1]


RUN = """
data: {name: conversations, path: DATA, tokenizer: TOKENIZER, image_size: 8, channels: 3, heldout_fraction: 0.25}
encoder: {patch_size: 4, dim: 32, depth: 1, heads: 2}
llm: {from_hf: CHECKPOINT}
train: {steps: 2, global_batch: 4, microbatches: 1, warmup_steps: 1, lr: 0.002, device: cpu}
eval: {final: false}
"""


def test_two_reference_steps_of_a_pretrained_llm_on_conversations(tmp_path):
    from dyad import config as config_lib
    from dyad.app.reference import ReferenceTrainer

    tokenizer_path = tokenizer_dir(tmp_path / "ckpt", CHATML)
    vocab_size = load_tokenizer(tokenizer_path).vocab_size
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, router_aux_loss_coef=0.0, tie_word_embeddings=False,
    )).save_pretrained(tmp_path / "ckpt")
    names = write_images(tmp_path, [(5 + k, 9 - k) for k in range(8)])
    records = [{"images": [name], "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
                                                    {"from": "gpt", "value": "A cat." if k % 2 else "Grey."}]}
               for k, name in enumerate(names)]
    data = write_jsonl(tmp_path / "c.jsonl", records)
    (tmp_path / "run.yaml").write_text(RUN.replace("DATA", str(data)).replace("TOKENIZER", str(tokenizer_path))
                                       .replace("CHECKPOINT", str(tmp_path / "ckpt")))
    config = config_lib.load(tmp_path / "run.yaml", [])
    dataset = make_dataset(config.data)
    config = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    trainer = ReferenceTrainer(config, dataset)
    spec = trainer.planner.next(0)
    # each sample's targets: its answer's two tokens or three, and <|im_end|>
    assert spec.target_tokens == sum(4 if "A cat." in dataset.sample(s).text else 3
                                     for mb in spec.microbatches for s in mb)
    trainer = ReferenceTrainer(config, dataset)  # from step 0 again
    losses = [trainer.step(step)["lm_loss"] for step in range(2)]
    assert all(np.isfinite(losses)) and losses[0] > 0
