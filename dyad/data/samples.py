"""Data config, samples, sequences and datasets: what the router plans with (without torch) and
what the two services read images from; `dyad/data/batch.py` makes their batches.

A sample is text with `<image>` placeholders plus the ids of its images in the dataset's image
table. `build_sequence` expands each placeholder into its image's tokens (LLaVA-style), as many
as `image_tokens` says that image gives (`dyad/data/image_tokens.py`), and marks the loss targets. A caption's sequence is [bos] + its tokens + [eos], and every text
token after bos is a target (eos included). A conversation's text is rendered by the checkpoint's
chat template (`dyad/data/chat.py`), which places its own special tokens: its sequence is the
text's tokens alone, and its targets are the tokens overlapping `Sample.target_spans` (the
assistant turns, with the end-of-turn token the template emits after each).

Shape legend: B batch rows, S padded sequence length, N image-token rows (the tokens of every
image of the batch), C channels, H = W = image_size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dyad.data.image_tokens import ImageTokens
from dyad.data.tokenizer import IMAGE, TextTokenizer

if TYPE_CHECKING:
    import torch

    from dyad.data.image_processor import ImageProcessor

IGNORE_INDEX = -100
DATASET_NAMES = ("digits", "jsonl", "conversations")
FILE_DATASETS = ("jsonl", "conversations")  # read from data.path
_DIGITS_ONLY_FIELDS = ("multi_image_fraction", "text_only_fraction")
_CONVERSATIONS_ONLY = (".json", ".tar", ".parquet")  # data.path's suffixes only "conversations" reads


@dataclass(kw_only=True)
class DataConfig:
    name: str = "digits"
    # The records: for "jsonl" a JSONL file; for "conversations" a JSONL file, LLaVA's .json
    # file, WebDataset .tar shards, .parquet files or a `datasets` save_to_disk directory, with
    # brace patterns and globs
    # ("shards/{000000..000099}.tar", "train-*.parquet"): dyad/data/sources.py.
    path: str | None = None
    # A tokenizer.json; None = word-level over the captions. "conversations" needs one: the chat
    # template is read from its directory (tokenizer_config.json or chat_template.jinja).
    tokenizer: str | None = None
    image_size: int = 16
    channels: int = 1
    heldout_fraction: float = 0.2
    multi_image_fraction: float = 0.0  # digits only
    text_only_fraction: float = 0.0  # digits only
    max_images_per_sample: int = 2

    def __post_init__(self):
        if self.name not in DATASET_NAMES:
            raise ValueError(f"data.name must be one of {DATASET_NAMES}, got {self.name!r}")
        if self.name in FILE_DATASETS and not self.path:
            raise ValueError(f"data.path is required when data.name is {self.name!r}")
        if self.name not in FILE_DATASETS and self.path is not None:
            raise ValueError(f"data.path is only used when data.name is one of {FILE_DATASETS}, got {self.path!r}")
        if self.name == "jsonl" and self.path and self.path.endswith(_CONVERSATIONS_ONLY):
            raise ValueError(f"data.path: data.name 'jsonl' reads one JSONL file, got {self.path!r}; LLaVA's JSON "
                             "files, tar shards and Parquet files hold data.name 'conversations'")
        if self.name == "conversations" and not self.tokenizer:
            raise ValueError("data.tokenizer is required when data.name is 'conversations': the chat template is "
                             "read from its directory")
        if self.image_size < 1:
            raise ValueError(f"data.image_size must be >= 1, got {self.image_size}")
        if self.channels not in (1, 3):
            raise ValueError(f"data.channels must be 1 or 3, got {self.channels}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(
                f"data.heldout_fraction must be in (0, 1), got {self.heldout_fraction}"
            )
        for field in _DIGITS_ONLY_FIELDS:
            value = getattr(self, field)
            if not 0 <= value < 1:
                raise ValueError(f"data.{field} must be in [0, 1), got {value}")
            if value and self.name != "digits":
                raise ValueError(f"data.{field} applies only to data.name 'digits', got {value}")
        if self.multi_image_fraction + self.text_only_fraction >= 1:
            raise ValueError(
                "data.multi_image_fraction + data.text_only_fraction must be < 1, got "
                f"{self.multi_image_fraction} + {self.text_only_fraction}"
            )
        if self.max_images_per_sample < 1:
            raise ValueError(
                f"data.max_images_per_sample must be >= 1, got {self.max_images_per_sample}"
            )
        if self.multi_image_fraction > 0 and self.max_images_per_sample < 2:
            raise ValueError(
                "data.max_images_per_sample must be >= 2 when data.multi_image_fraction > 0, "
                f"got {self.max_images_per_sample}"
            )


def answer_ends_text(text: str, answer: str) -> bool:
    """Whether `answer` is the last whole word(s) of `text`."""
    start = len(text) - len(answer)
    at_word_start = start == 0 or text[start - 1].isspace()
    return bool(answer.strip()) and text.endswith(answer) and at_word_start


@dataclass(frozen=True)
class Sample:
    sample_id: int
    image_ids: tuple[int, ...]  # image table ids, in the order of the <image> placeholders
    text: str  # holds exactly len(image_ids) <image> placeholders
    answer: str | None = None  # the caption's final word(s) that caption-accuracy eval predicts
    # None: a caption. Otherwise a rendered conversation, whose targets are the tokens overlapping
    # these character spans [start, end) of `text`.
    target_spans: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        if self.text.count(IMAGE) != len(self.image_ids):
            raise ValueError(
                f"sample {self.sample_id}: text has {self.text.count(IMAGE)} {IMAGE} "
                f"placeholders but {len(self.image_ids)} images"
            )
        if self.answer is not None and not answer_ends_text(self.text, self.answer):
            raise ValueError(
                f"sample {self.sample_id}: answer {self.answer!r} must be the last word(s) of the "
                f"text {self.text!r}"
            )
        assert self.answer is None or self.target_spans is None, "caption-accuracy eval is for captions"

    @property
    def prompt_text(self) -> str | None:
        """The text before `answer`: what eval feeds the model before it predicts the answer."""
        if self.answer is None:
            return None
        return self.text[: len(self.text) - len(self.answer)].rstrip()


@dataclass(frozen=True)
class SampleShape:
    sample_id: int
    n_images: int
    seq_len: int  # after image expansion (a caption's includes bos and eos)
    n_targets: int  # positions with a loss target (a caption's: every text token after bos, and eos)


def _expand_images(tokenizer: TextTokenizer, text_ids: list[int], image_counts: list[int]) -> list[int]:
    """`text_ids` with its k-th image id repeated image_counts[k] times."""
    counts = iter(image_counts)
    ids = []
    for token in text_ids:
        ids.extend([token] * (next(counts) if token == tokenizer.image_id else 1))
    return ids


def _image_counts(sample: Sample, image_tokens: ImageTokens) -> list[int]:
    counts = [image_tokens(image_id) for image_id in sample.image_ids]
    assert all(count >= 1 for count in counts), (sample.sample_id, counts)
    return counts


def _text_targets(tokenizer: TextTokenizer, sample: Sample) -> tuple[list[int], list[bool]]:
    """The sample's token ids before image expansion (a caption's with bos and eos) and whether
    each is a loss target."""
    if sample.target_spans is None:
        ids = [tokenizer.bos_id, *tokenizer.encode(sample.text), tokenizer.eos_id]
        return ids, [False] + [token != tokenizer.image_id for token in ids[1:]]
    ids, offsets = tokenizer.encode_with_offsets(sample.text)
    is_target = [
        token != tokenizer.image_id and any(start < end_s and end > start_s for start_s, end_s in sample.target_spans)
        for token, (start, end) in zip(ids, offsets)
    ]
    return ids, is_target


def build_sequence(
    tokenizer: TextTokenizer, sample: Sample, image_tokens: ImageTokens
) -> tuple[list[int], list[int], list[int]]:
    """Returns (input_ids, targets, image_positions) for one sample.

    input_ids = the text's ids (a caption's between bos and eos) with each <image> expanded to
    as many image ids as `image_tokens` gives its image; targets[i] = input_ids[i + 1] where that token is a target (see the
    module docstring), else IGNORE_INDEX; image_positions = the indices of image tokens in input_ids.
    """
    text_ids, is_target = _text_targets(tokenizer, sample)
    assert text_ids.count(tokenizer.image_id) == len(sample.image_ids), sample
    counts = iter(_image_counts(sample, image_tokens))
    ids, predicted = [], []  # predicted[i]: whether input_ids[i] is a target
    for token, target in zip(text_ids, is_target):
        copies = next(counts) if token == tokenizer.image_id else 1
        ids.extend([token] * copies)
        predicted.extend([target] * copies)
    targets = [nxt if target else IGNORE_INDEX for nxt, target in zip(ids[1:], predicted[1:])] + [IGNORE_INDEX]
    image_positions = [i for i, token in enumerate(ids) if token == tokenizer.image_id]
    return ids, targets, image_positions


def build_prompt(
    tokenizer: TextTokenizer, sample: Sample, image_tokens: ImageTokens
) -> tuple[list[int], list[int], list[int]]:
    """For caption-accuracy eval: (input_ids, image_positions, answer_ids), where input_ids is
    [bos] + the expanded prompt_text and answer_ids are the answer's tokens as they appear in the
    full caption (greedy decoding from input_ids should produce them, then eos)."""
    if sample.answer is None:
        raise ValueError(f"sample {sample.sample_id} has no answer to evaluate")
    full_ids = tokenizer.encode(sample.text)
    prompt_ids = tokenizer.encode(sample.prompt_text)
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            f"sample {sample.sample_id}: the tokenizer merges the answer {sample.answer!r} "
            "into the prompt, so the prompt is not a token prefix of the caption"
        )
    ids = _expand_images(tokenizer, [tokenizer.bos_id, *prompt_ids], _image_counts(sample, image_tokens))
    image_positions = [i for i, token in enumerate(ids) if token == tokenizer.image_id]
    return ids, image_positions, full_ids[len(prompt_ids) :]


def answer_targets(tokenizer: TextTokenizer, sample: Sample, image_tokens: ImageTokens) -> range:
    """The positions of `build_sequence`'s sequence whose targets are the answer's tokens (empty
    where the sample has no answer). Every one of them is the model's argmax exactly when greedy
    decoding from the prompt (`build_prompt`) produces the answer: until the first miss both
    see the same tokens."""
    if sample.answer is None:
        return range(0)
    prompt_ids, _, answer_ids = build_prompt(tokenizer, sample, image_tokens)
    return range(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(answer_ids))


class MultimodalDataset(ABC):
    """Samples, their image table and a fixed train/held-out split (independent of the run seed).
    Subclasses fill the samples and split in __init__ and implement `images`."""

    def __init__(
        self,
        *,
        tokenizer: TextTokenizer,
        samples: list[Sample],
        heldout_ids: Sequence[int],
        image_size: int,
        channels: int,
    ):
        assert all(s.sample_id == i for i, s in enumerate(samples)), "sample_id must be the index"
        self.tokenizer = tokenizer
        self.image_size = image_size
        self.channels = channels
        self._samples = samples
        heldout = set(heldout_ids)
        self.heldout_ids: list[int] = sorted(heldout)
        self.train_ids: list[int] = [i for i in range(len(samples)) if i not in heldout]
        self._n_text_tokens: dict[int, tuple[int, int]] = {}  # (text tokens, targets)

    def __len__(self) -> int:
        return len(self._samples)

    def sample(self, i: int) -> Sample:
        return self._samples[i]

    def shape(self, i: int, image_tokens: ImageTokens) -> SampleShape:
        sample = self._samples[i]
        if i not in self._n_text_tokens:
            text_ids, is_target = _text_targets(self.tokenizer, sample)
            self._n_text_tokens[i] = (len(text_ids) - len(sample.image_ids), sum(is_target))
        n_text, n_targets = self._n_text_tokens[i]
        return SampleShape(
            sample_id=i,
            n_images=len(sample.image_ids),
            seq_len=n_text + sum(_image_counts(sample, image_tokens)),
            n_targets=n_targets,
        )

    @abstractmethod
    def images(
        self,
        image_ids: Sequence[int],
        device: torch.device | str | None = None,
        processor: ImageProcessor | None = None,
    ) -> torch.Tensor:
        """The images as float32, shape [len(image_ids), C, H, W] (n may be 0), on `device`
        (default CPU): as `processor` prepares them (the vision checkpoint's, where it has one),
        else in [0, 1] at image_size x image_size."""
