"""Image-caption data from a JSONL file.

Format: one JSON object per line, in UTF-8; blank lines are skipped.

    {"images": ["cats/1.png", "/data/dog.jpg"], "caption": "<image> a cat <image> a dog"}
    {"images": ["cats/2.png"], "caption": "a sleeping cat", "split": "heldout"}
    {"images": ["cats/3.png"], "caption": "<image> the animal is a cat", "answer": "cat"}
    {"images": [], "caption": "text-only samples have no images"}

- "images" (required): a list of image paths, relative to the JSONL file's directory or absolute;
  any format Pillow reads. Images are converted to L (channels=1) or RGB (channels=3), resized to
  image_size x image_size (bilinear, aspect ratio not kept) and scaled to [0, 1].
- "caption" (required, non-empty): the text. If it holds no `<image>` placeholder, one per image is
  prepended ("<image> <image> caption"); otherwise it must hold exactly one per image, and
  placeholder k stands for images[k].
- "split" (optional): "train" (default) or "heldout". If no record says "heldout", a deterministic
  data.heldout_fraction of the records (seed 0, independent of the run seed) is held out.
- "answer" (optional): the caption's last word(s), predicted in caption-accuracy eval.

Every record is validated when the dataset loads (every image is decoded once); all bad records are
reported together in one `DatasetError`, one "<file>:<line>: <problem>" per problem.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
from PIL import Image

from dyad.data.samples import DataConfig, MultimodalDataset, Sample, answer_ends_text
from dyad.data.tokenizer import IMAGE, build_word_tokenizer, load_tokenizer

if TYPE_CHECKING:
    import torch

    from dyad.data.image_processor import ImageProcessor

SEED = 0
SPLITS = ("train", "heldout")


class DatasetError(ValueError):
    """Bad records in a dataset file; the message lists each one as "<file>:<line>: <problem>"."""


def read_image(file: Path | BinaryIO, name: str) -> tuple[tuple[int, int] | None, str | None]:
    """((height, width), None) once the image decodes, else (None, the problem)."""
    if isinstance(file, Path) and not file.is_file():
        return None, f"image {name!r} not found"
    try:
        with Image.open(file) as image:
            image.load()
            return (image.height, image.width), None
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for corrupt files
        return None, f"image {name!r} cannot be read: {e}"


def json_object(line: bytes) -> tuple[dict | None, str | None]:
    """(the line's JSON object, None), or (None, the problem)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 at byte {e.start + 1} of the line ({line[e.start]:#04x}: {e.reason})"
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e}"
    except RecursionError:  # json's decoder recurses once per level
        return None, "JSON nested too deeply"
    if not isinstance(record, dict):
        return None, f"a record must be a JSON object, got {type(record).__name__}"
    return record, None


def read_records(cfg: DataConfig, parse) -> list:
    """`parse(line)` -> (record, problems) for each non-blank line of data.path; every problem of
    every line raised together in one DatasetError."""
    path = Path(cfg.path)
    if not path.is_file():
        raise ValueError(f"data.path: file not found: '{cfg.path}'")
    records, errors = [], []
    # Bytes: a line that is not UTF-8 is one record's problem, named by its line.
    for line_no, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        record, problems = parse(line)
        errors += [f"{cfg.path}:{line_no}: {p}" for p in problems]
        records.append(record)
    if errors:
        raise DatasetError(f"{len(errors)} problem(s) in {cfg.path}:\n" + "\n".join(errors))
    if not records:
        raise ValueError(f"data.path: no records in '{cfg.path}'")
    return records


def heldout_split(splits: list[str], fraction: float) -> list[int]:
    """The records whose split is "heldout"; where none is, a deterministic `fraction` of them
    (seed 0, independent of the run seed; at least one, never all)."""
    heldout = [i for i, split in enumerate(splits) if split == "heldout"]
    if not heldout and len(splits) > 1:
        n_heldout = min(max(round(fraction * len(splits)), 1), len(splits) - 1)
        heldout = np.random.default_rng(SEED).permutation(len(splits))[:n_heldout].tolist()
    return heldout


def _parse_record(
    line: bytes, root: Path, max_images: int
) -> tuple[tuple[list[Path], list[tuple[int, int]], str, str, str | None] | None, list[str]]:
    """Returns (record, problems); record is (image_paths, their (height, width)s, text, split, answer)."""
    record, problem = json_object(line)
    if problem:
        return None, [problem]
    problems = [f"missing field {f!r}" for f in ("images", "caption") if f not in record]
    if problems:
        return None, problems
    images, caption = record["images"], record["caption"]
    split, answer = record.get("split", "train"), record.get("answer")
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        problems.append("'images' must be a list of strings")
        images = []
    if not isinstance(caption, str) or not caption.replace(IMAGE, "").strip():
        return None, problems + ["empty caption"]
    if split not in SPLITS:
        problems.append(f"'split' must be one of {SPLITS}, got {split!r}")
    if len(images) > max_images:
        problems.append(
            f"{len(images)} images, more than data.max_images_per_sample={max_images}"
        )
    n_placeholders = caption.count(IMAGE)
    if n_placeholders == 0:
        caption = " ".join([IMAGE] * len(images) + [caption.strip()])
    elif n_placeholders != len(images):
        problems.append(
            f"caption has {n_placeholders} {IMAGE} placeholders but {len(images)} images"
        )
    caption = caption.rstrip()
    if answer is not None and not (isinstance(answer, str) and answer_ends_text(caption, answer)):
        problems.append(f"'answer' {answer!r} must be the caption's last word(s)")
    paths = [root / name for name in images]
    sizes = [read_image(path, name) for name, path in zip(images, paths)]
    problems += [problem for _, problem in sizes if problem]
    return (paths, [hw for hw, _ in sizes], caption, split, answer), problems


class ImageTable:
    """A dataset's distinct images, each with an id (in the order first seen), its locator (a
    path, or where a source keeps its bytes) and its stored (height, width)."""

    def __init__(self):
        self.locators: list = []
        self.hw: list[tuple[int, int]] = []
        self._ids: dict = {}

    def __contains__(self, locator) -> bool:
        return locator in self._ids

    def add(self, locator, hw: tuple[int, int] | None) -> int:
        """The id of the image at `locator`, added with its size `hw` where it is new."""
        if locator not in self._ids:
            assert hw is not None, locator
            self._ids[locator] = len(self.locators)
            self.locators.append(locator)
            self.hw.append(hw)
        return self._ids[locator]


class ImageFilesDataset(MultimodalDataset):
    """A dataset whose images are stored: files, or bytes in tar shards or tables. Subclasses fill
    `_images` and implement `image_file`."""

    _images: ImageTable

    @abstractmethod
    def image_file(self, image_id: int) -> Path | BinaryIO:
        """The image's file, or its bytes as an open binary file: what Pillow opens."""

    def image_hw(self, image_id: int) -> tuple[int, int]:
        """The image's (height, width) as stored, before any preparation (torch-free: a native-
        resolution tower's tokens per image follow from it, `PatchGrid.image_tokens`)."""
        return self._images.hw[image_id]

    def images(
        self,
        image_ids: Sequence[int],
        device: torch.device | str | None = None,
        processor: ImageProcessor | None = None,
    ) -> torch.Tensor:
        from dyad.data import pixels  # torch: the services call this, the router never

        files = [self.image_file(i) for i in image_ids]
        if processor is not None:
            return pixels.prepared(files, processor, device)
        return pixels.decoded(files, self.image_size, self.channels, device)

    def patches(
        self, image_ids: Sequence[int], processor: ImageProcessor, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The images at their native resolution, as a Qwen2-VL processor (`processor.patches`)
        prepares them: (pixel_values [patches, C * T * p * p], image_grid_thw [len(image_ids), 3])."""
        from dyad.data import pixels

        return pixels.patches([self.image_file(i) for i in image_ids], processor, device)


class JsonlDataset(ImageFilesDataset):
    def __init__(self, cfg: DataConfig):
        root = Path(cfg.path).parent
        records = read_records(cfg, lambda line: _parse_record(line, root, cfg.max_images_per_sample))

        self._images = ImageTable()
        samples = []
        for i, (paths, sizes, text, _, answer) in enumerate(records):
            image_ids = tuple(self._images.add(path.resolve(), hw) for path, hw in zip(paths, sizes))
            samples.append(Sample(sample_id=i, image_ids=image_ids, text=text, answer=answer))
        heldout = heldout_split([split for *_, split, _ in records], cfg.heldout_fraction)
        tokenizer = (
            load_tokenizer(cfg.tokenizer)
            if cfg.tokenizer
            else build_word_tokenizer(s.text for s in samples)
        )
        super().__init__(
            tokenizer=tokenizer,
            samples=samples,
            heldout_ids=heldout,
            image_size=cfg.image_size,
            channels=cfg.channels,
        )

    def image_file(self, image_id: int) -> Path:
        return self._images.locators[image_id]
