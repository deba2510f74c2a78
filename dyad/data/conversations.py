"""Image conversations, rendered with the checkpoint's chat template (`dyad/data/chat.py`), the
loss on the assistant turns only. `data.name: conversations`.

The records come from `data.path` (`dyad/data/sources.py`): a JSONL file, described here;
a JSON file holding a list of records, as LLaVA ships its data, each record's images in "image"
(one path, a list, or absent for none) or "images" (`LlavaJson`); WebDataset tar shards, a
record and its images per sample key (`dyad/data/shards.py`); or Parquet files or an Arrow
directory, a record per row with its images in the table (`dyad/data/tables.py`). A record is
the same in each, but for where its images are.

JSONL: one JSON object per line, in UTF-8; blank lines are skipped. Either LLaVA's:

    {"images": ["cats/1.png"], "conversations": [
        {"from": "human", "value": "<image>\\nWhat is this?"}, {"from": "gpt", "value": "A cat."},
        {"from": "human", "value": "What colour?"}, {"from": "gpt", "value": "Grey."}]}

("from": "human" or "user", "gpt" or "assistant", "system"; "value": a string), or OpenAI's:

    {"images": ["cats/1.png"], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."}]}

("role": "system", "user" or "assistant"; "content": a string, or a list of {"type": "text",
"text": ...} and {"type": "image"} parts, joined with newlines into the string the template sees,
each image part as `<image>`).

- "images" (required): image paths, relative to the JSONL file's directory or absolute; any format
  Pillow reads. The k-th `<image>` of the conversation stands for images[k]. A LLaVA record with
  images but no `<image>` gets one per image, each followed by a newline, before its first user
  turn's text; otherwise the count must match.
- At least one assistant turn with non-empty content; the targets are the assistant turns'
  tokens and the template's end-of-turn token after each (`dyad/data/chat.py` says exactly which).
- "split" (optional): "train" (default) or "heldout", as in `dyad/data/jsonl.py`.

Images are prepared as the vision checkpoint's image processor does where `encoder.from_hf` holds
a preprocessor_config.json (`dyad/data/image_processor.py`: at one size, `images`, or at their
own, `patches`), else as jsonl's. Every record is validated and rendered, and every image decoded,
when the dataset loads; all bad records are reported together in one `DatasetError`, one
"<where>: <problem>" per problem, where is "<file>:<line>" in JSONL, "<shard>:<key>" in tar shards
and "<file>:row <n>" in tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import jinja2

from dyad.data.chat import ChatTemplate, load_chat_template
from dyad.data.jsonl import SPLITS, DatasetError, ImageFilesDataset, ImageTable, heldout_split, read_image
from dyad.data.raw_records import RawRecord
from dyad.data.samples import DataConfig, Sample
from dyad.data.sources import open_source
from dyad.data.tokenizer import IMAGE, load_tokenizer

LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")


def _llava_messages(turns) -> tuple[list[dict], list[str]]:
    if not isinstance(turns, list) or not turns:
        return [], ["'conversations' must be a non-empty list of turns"]
    messages, problems = [], []
    for k, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or turn.get("from") not in LLAVA_ROLES or not isinstance(turn.get("value"), str):
            problems.append(f"turn {k} must be {{\"from\": one of {sorted(LLAVA_ROLES)}, \"value\": a string}}")
            continue
        messages.append({"role": LLAVA_ROLES[turn["from"]], "content": turn["value"]})
    return messages, problems


def _content(content) -> str | None:
    """A message's content as the string the template sees; None where it is malformed."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image":
            parts.append(IMAGE)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            return None
    return "\n".join(parts)


def _openai_messages(raw) -> tuple[list[dict], list[str]]:
    if not isinstance(raw, list) or not raw:
        return [], ["'messages' must be a non-empty list of messages"]
    messages, problems = [], []
    for k, message in enumerate(raw, start=1):
        content = _content(message.get("content")) if isinstance(message, dict) else None
        if not isinstance(message, dict) or message.get("role") not in ROLES or content is None:
            problems.append(f"message {k} must be {{\"role\": one of {list(ROLES)}, \"content\": a string or a list "
                            "of text and image parts}")
            continue
        messages.append({"role": message["role"], "content": content})
    return messages, problems


def _with_placeholders(messages: list[dict], n_images: int) -> list[dict]:
    """LLaVA's convention: images without placeholders lead the first user turn."""
    if n_images == 0 or any(IMAGE in m["content"] for m in messages):
        return messages
    first = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        return messages
    lead = {**messages[first], "content": f"{IMAGE}\n" * n_images + messages[first]["content"]}
    return [*messages[:first], lead, *messages[first + 1 :]]


def parse_conversation(record: dict, n_images: int, max_images: int, template: ChatTemplate):
    """Returns ((text, target_spans, split) or None, problems) for a record with `n_images` images."""
    kinds = [key for key in ("conversations", "messages") if key in record]
    if len(kinds) != 1:
        return None, ["a record needs one of 'conversations' (LLaVA) or 'messages' (OpenAI)"]
    split = record.get("split", "train")
    problems = []
    if split not in SPLITS:
        problems.append(f"'split' must be one of {SPLITS}, got {split!r}")
    if n_images > max_images:
        problems.append(f"{n_images} images, more than data.max_images_per_sample={max_images}")
    if kinds == ["conversations"]:
        messages, message_problems = _llava_messages(record["conversations"])
        messages = _with_placeholders(messages, n_images)
    else:
        messages, message_problems = _openai_messages(record["messages"])
    problems += message_problems
    if not message_problems:
        problems += _conversation_problems(messages, n_images)
    if problems:
        return None, problems
    try:
        text = template.render(messages)
        spans = template.assistant_spans(messages, text)
    except (jinja2.TemplateError, ValueError) as e:  # a template's raise_exception, or an unlocatable turn
        return None, [f"chat template: {e}"]
    if text.count(IMAGE) != n_images:
        return None, [f"the chat template's text has {text.count(IMAGE)} {IMAGE} placeholders, not {n_images}"]
    return (text, tuple(spans), split), []


def _conversation_problems(messages: list[dict], n_images: int) -> list[str]:
    problems = []
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        problems.append("no assistant turn with content: nothing to learn")
    if any(IMAGE in m["content"] for m in messages if m["role"] == "assistant"):
        problems.append(f"an assistant turn holds {IMAGE}: images belong to the user's and system's turns")
    n_placeholders = sum(m["content"].count(IMAGE) for m in messages)
    if n_placeholders != n_images:
        problems.append(f"{n_placeholders} {IMAGE} placeholders but {n_images} images")
    return problems


class ConversationsDataset(ImageFilesDataset):
    def __init__(self, cfg: DataConfig):
        tokenizer = load_tokenizer(cfg.tokenizer)
        template = load_chat_template(cfg.tokenizer, tokenizer.special_tokens)
        self._source = open_source(cfg.path)
        self._images = ImageTable()
        samples, splits, errors = [], [], []
        for raw in self._source.records():
            parsed, problems = self._parse(raw, cfg.max_images_per_sample, template)
            errors += [f"{raw.where}: {p}" for p in problems]
            if parsed is not None:
                text, spans, split, image_ids = parsed
                samples.append(Sample(sample_id=len(samples), image_ids=image_ids, text=text, target_spans=spans))
                splits.append(split)
        if errors:
            raise DatasetError(f"{len(errors)} problem(s) in {cfg.path}:\n" + "\n".join(errors))
        if not samples:
            raise ValueError(f"data.path: no records in '{cfg.path}'")
        super().__init__(
            tokenizer=tokenizer,
            samples=samples,
            heldout_ids=heldout_split(splits, cfg.heldout_fraction),
            image_size=cfg.image_size,
            channels=cfg.channels,
        )

    def _parse(self, raw: RawRecord, max_images: int, template: ChatTemplate):
        """((text, target_spans, split, image_ids) or None, problems) for one record."""
        problems = list(raw.problems)
        parsed = None
        if raw.record is not None:
            parsed, record_problems = parse_conversation(raw.record, len(raw.images), max_images, template)
            problems += record_problems
        image_ids = []
        for name, locator in raw.images:
            image_id, problem = self._image_id(name, locator)
            image_ids.append(image_id)
            problems += [problem] if problem else []
        if problems or parsed is None:
            return None, problems
        return (*parsed, tuple(image_ids)), []

    def _image_id(self, name: str, locator) -> tuple[int | None, str | None]:
        """The image's id in the table, decoded (validated, its size read) when first seen; or its problem."""
        if locator is None:
            return None, f"image {name!r} not found"
        hw = None
        if locator not in self._images:
            hw, problem = read_image(self._source.open(locator), name)
            if problem:
                return None, problem
        return self._images.add(locator, hw), None

    def image_file(self, image_id: int) -> Path | BinaryIO:
        return self._source.open(self._images.locators[image_id])
