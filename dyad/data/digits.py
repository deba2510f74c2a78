"""The built-in dataset: scikit-learn's 1,797 handwritten 8x8 digits, captioned "<image> this is
the digit seven". `digits.npz` beside this file holds them (pixels 0..16 and labels, as uint8), a
copy of `sklearn.datasets.load_digits()` (from the UCI "Optical Recognition of Handwritten Digits"
set, CC BY 4.0), so that no process pays scikit-learn's slow import to read them;
tests/unit/test_data.py checks the copy against scikit-learn's.

Composition is fixed by seed 0, independent of the run seed: heldout_fraction of the IMAGES is
held out, and held-out samples use only held-out images. Each image gets one single-image sample;
multi-image ("<image> <image> these are the digits seven and two") and text-only ("the digit after
three is four") samples are added so that they make up multi_image_fraction and
text_only_fraction of each split's samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

from dyad.data.samples import DataConfig, MultimodalDataset, Sample
from dyad.data.tokenizer import IMAGE, TextTokenizer, build_word_tokenizer, load_tokenizer

if TYPE_CHECKING:
    import torch

    from dyad.data.image_processor import ImageProcessor

SEED = 0
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# Every word any composition can produce, so the word-level vocabulary (and with it a checkpoint's
# embedding table) does not depend on the fractions in the config.
VOCABULARY_TEXTS = (" ".join(DIGIT_WORDS), "this is the digit", "these are the digits and",
                    "the digit after before is")


def single_caption(digit: int) -> tuple[str, str]:
    """(text, answer) for one image."""
    return f"{IMAGE} this is the digit {DIGIT_WORDS[digit]}", DIGIT_WORDS[digit]


def multi_caption(digits: Sequence[int]) -> tuple[str, str]:
    words = [DIGIT_WORDS[d] for d in digits]
    placeholders = " ".join([IMAGE] * len(digits))
    return f"{placeholders} these are the digits {' '.join(words[:-1])} and {words[-1]}", words[-1]


def text_only_caption(rng: np.random.Generator) -> tuple[str, str]:
    if rng.random() < 0.5:
        d = int(rng.integers(0, 9))
        return f"the digit after {DIGIT_WORDS[d]} is {DIGIT_WORDS[d + 1]}", DIGIT_WORDS[d + 1]
    d = int(rng.integers(1, 10))
    return f"the digit before {DIGIT_WORDS[d]} is {DIGIT_WORDS[d - 1]}", DIGIT_WORDS[d - 1]


def _compose(
    pool: np.ndarray, labels: np.ndarray, cfg: DataConfig, rng: np.random.Generator
) -> list[tuple[tuple[int, ...], str, str]]:
    """(image_ids, text, answer) for one split's image pool, in a deterministic shuffled order."""
    n_total = round(len(pool) / (1 - cfg.multi_image_fraction - cfg.text_only_fraction))
    n_multi = round(cfg.multi_image_fraction * n_total) if len(pool) >= 2 else 0
    n_text_only = round(cfg.text_only_fraction * n_total)
    composed = [((int(i),), *single_caption(labels[i])) for i in pool]
    for _ in range(n_multi):
        k = int(rng.integers(2, min(cfg.max_images_per_sample, len(pool)) + 1))
        image_ids = tuple(int(i) for i in rng.choice(pool, size=k, replace=False))
        composed.append((image_ids, *multi_caption([labels[i] for i in image_ids])))
    composed += [((), *text_only_caption(rng)) for _ in range(n_text_only)]
    return [composed[j] for j in rng.permutation(len(composed))]


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The bundled digits: pixels [1797, 64] (0..16) and labels [1797], both int64."""
    with resources.files("dyad.data").joinpath("digits.npz").open("rb") as file, np.load(file) as stored:
        return stored["pixels"].astype(np.int64), stored["labels"].astype(np.int64)


class DigitsDataset(MultimodalDataset):
    def __init__(self, cfg: DataConfig):
        pixels, labels = load_digits()  # [1797, 64] in 0..16, [1797]
        # Kept at 8x8 and upsampled per request: 1,797 images at 224x224x3 would take 1 GB.
        self._digits_N188 = pixels.astype(np.float32).reshape(-1, 1, 8, 8) / np.float32(16.0)
        self.labels = labels

        rng = np.random.default_rng(SEED)
        order = rng.permutation(len(labels))
        n_heldout = min(max(round(cfg.heldout_fraction * len(labels)), 1), len(labels) - 1)
        self.heldout_images = np.sort(order[:n_heldout])
        self.train_images = np.sort(order[n_heldout:])
        train = _compose(self.train_images, labels, cfg, rng)
        heldout = _compose(self.heldout_images, labels, cfg, rng)
        samples = [
            Sample(sample_id=i, image_ids=image_ids, text=text, answer=answer)
            for i, (image_ids, text, answer) in enumerate(train + heldout)
        ]
        tokenizer: TextTokenizer = (
            load_tokenizer(cfg.tokenizer)
            if cfg.tokenizer
            else build_word_tokenizer(VOCABULARY_TEXTS)
        )
        super().__init__(
            tokenizer=tokenizer,
            samples=samples,
            heldout_ids=range(len(train), len(samples)),
            image_size=cfg.image_size,
            channels=cfg.channels,
        )

    def images(
        self,
        image_ids: Sequence[int],
        device: torch.device | str | None = None,
        processor: ImageProcessor | None = None,
    ) -> torch.Tensor:
        """Upsampled on `device`: the 8x8 originals travel, not the full-size images (90 images of
        336 pixels are 120 MB, slow to upsample on one CPU thread). A stand-in for real images,
        they keep this preparation whatever `processor` a vision checkpoint has."""
        from dyad.data.pixels import upsampled  # torch: the services call this, the router never

        return upsampled(self._digits_N188[list(image_ids)], self.image_size, self.channels, device)
