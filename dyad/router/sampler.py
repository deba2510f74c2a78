"""Which samples each step trains on: a seeded permutation per epoch and a cursor into it.

The cursor is the only state; it is what a checkpoint stores so that no sample of an epoch is
lost or repeated after a restart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    offset: int = 0  # samples of this epoch already handed out


class EpochSampler:
    def __init__(self, sample_ids: Sequence[int], seed: int, cursor: Cursor = Cursor()):
        if not sample_ids:
            raise ValueError("the training split has no samples")
        self._ids = list(sample_ids)
        self._seed = seed
        self.cursor = cursor

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(self._ids)
        random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[int]:
        """The next `size` samples; a batch that runs past an epoch continues into the next."""
        batch: list[int] = []
        epoch, offset = self.cursor.epoch, self.cursor.offset
        while len(batch) < size:
            order = self._epoch_order(epoch)
            take = order[offset : offset + size - len(batch)]
            batch.extend(take)
            offset += len(take)
            if offset == len(order):
                epoch, offset = epoch + 1, 0
        self.cursor = Cursor(epoch, offset)
        return batch


def split_microbatches(sample_ids: Sequence[int], count: int) -> list[list[int]]:
    """Split into `count` contiguous, near-equal microbatches (the first ones one larger)."""
    base, extra = divmod(len(sample_ids), count)
    parts, start = [], 0
    for index in range(count):
        end = start + base + (1 if index < extra else 0)
        parts.append(list(sample_ids[start:end]))
        start = end
    return parts
