"""Multimodal data: datasets of image-caption samples and of image conversations rendered with a
checkpoint's chat template, the tokenizer, how a vision checkpoint prepares images, and the sequence layout
shared by the router (plans with `SampleShape`) and the services (consume `Batch`, made by
`dyad.data.batch.collate`). Importing this package does not import torch: the router plans
steps without it; a dataset's `images` imports it when the services call it."""

from collections.abc import Callable

from dyad.data.conversations import ConversationsDataset
from dyad.data.digits import DigitsDataset
from dyad.data.image_processor import ImageProcessor, read_image_processor
from dyad.data.image_tokens import FixedTokens, ImageTokens, NativeTokens
from dyad.data.jsonl import DatasetError, JsonlDataset
from dyad.data.samples import (
    DATASET_NAMES,
    IGNORE_INDEX,
    DataConfig,
    MultimodalDataset,
    Sample,
    SampleShape,
    answer_targets,
    build_prompt,
    build_sequence,
)
from dyad.data.tokenizer import TextTokenizer, build_word_tokenizer, load_tokenizer

DATASETS: dict[str, Callable[[DataConfig], MultimodalDataset]] = {
    "digits": DigitsDataset,
    "jsonl": JsonlDataset,
    "conversations": ConversationsDataset,
}
assert set(DATASETS) == set(DATASET_NAMES), "DataConfig validates names against DATASET_NAMES"


def make_dataset(cfg: DataConfig) -> MultimodalDataset:
    return DATASETS[cfg.name](cfg)


__all__ = [
    "DATASETS",
    "IGNORE_INDEX",
    "ConversationsDataset",
    "DataConfig",
    "DatasetError",
    "DigitsDataset",
    "FixedTokens",
    "ImageProcessor",
    "ImageTokens",
    "JsonlDataset",
    "MultimodalDataset",
    "NativeTokens",
    "Sample",
    "SampleShape",
    "TextTokenizer",
    "answer_targets",
    "build_prompt",
    "build_sequence",
    "build_word_tokenizer",
    "load_tokenizer",
    "make_dataset",
    "read_image_processor",
]
