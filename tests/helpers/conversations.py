"""Conversation data the tests write: a word-level tokenizer with a chat template, images, and
JSONL records."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

CHATML = (  # Qwen2.5's shape: a default system turn
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<s>", "</s>")
WORDS = ["system", "user", "assistant", "You", "are", "a", "helpful", "What", "is", "this", "?", "A", "cat", ".",
         "colour", "Grey", "INST", "/", "[", "]", "Be", "brief"]


def tokenizer_dir(path, template: str = CHATML, bos: str = "<s>", eos: str = "</s>", jinja_file: bool = False,
                  words=WORDS):
    """A word-level tokenizer.json of `words` with chat special tokens, and its tokenizer_config.json."""
    path.mkdir()
    vocab = {token: i for i, token in enumerate(["<unk>", *SPECIALS, *words])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "unk_token": "<unk>"}
    if jinja_file:
        (path / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path / "tokenizer.json"


def write_images(root, sizes, mode="RGB", seed=0):
    """PNGs of random pixels, (width, height) each, in `root`; their names."""
    rng = np.random.default_rng(seed)
    names = []
    for k, (w, h) in enumerate(sizes):
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        pixels = rng.integers(0, 256, (h, w, channels), dtype=np.uint8).squeeze(-1 if channels == 1 else None)
        Image.fromarray(pixels, mode).save(root / f"{mode}{k}.png")
        names.append(f"{mode}{k}.png")
    return names


def write_jsonl(path, records):
    """One line per record: a dict as JSON, a string as it is."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
