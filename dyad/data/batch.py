"""A microbatch as the two services consume it: the samples' sequences right-padded into
tensors (`collate`). Shape legend as in `dyad/data/samples.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dyad.data.image_tokens import ImageTokens
from dyad.data.samples import IGNORE_INDEX, Sample, build_sequence
from dyad.data.tokenizer import TextTokenizer


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] int64, right-padded with pad_id
    targets: torch.Tensor  # [B, S] int64, IGNORE_INDEX at pads, image tokens and the last token
    image_positions: torch.Tensor  # [N] int64, flat indices into B*S, in image_ids row order
    image_ids: tuple[int, ...]  # image table ids: sample order, then placeholder order
    lengths: torch.Tensor  # [B] int64, unpadded sequence lengths
    n_targets: int
    # Each image's grid of tokens (frames, rows, columns), in image_ids order; () where the
    # tower lays none out (`ImageTokens.token_grid`).
    image_grids: tuple[tuple[int, int, int], ...] = ()
    # Packed rows (`collate`'s row_sizes): each column's sample, numbered across the rows (-1 on
    # padding), and its position in that sample; None: one sample a row.
    documents: torch.Tensor | None = None  # [B, S] int64
    sample_positions: torch.Tensor | None = None  # [B, S] int64

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Batch(
            input_ids=move(self.input_ids),
            targets=move(self.targets),
            image_positions=move(self.image_positions),
            image_ids=self.image_ids,
            lengths=move(self.lengths),
            n_targets=self.n_targets,
            image_grids=self.image_grids,
            documents=move(self.documents),
            sample_positions=move(self.sample_positions),
        )


def collate(
    tokenizer: TextTokenizer, samples: Sequence[Sample], image_tokens: ImageTokens, row_sizes: Sequence[int] = ()
) -> Batch:
    """Right-pads the samples' sequences into one batch: one sample a row, or, given `row_sizes`
    (how many of the samples, in order, each row holds: a packed microbatch), each row's samples
    one after another, `documents` numbering each column's sample and `sample_positions`
    counting each sample's columns from 0. Row k of the encoder output for `image_ids` (each
    image's `image_tokens` rows, one image after another: [N, D]) belongs at `image_positions[k]`."""
    assert samples, "collate needs at least one sample"
    sizes = list(row_sizes) or [1] * len(samples)
    if sum(sizes) != len(samples) or min(sizes) < 1:
        raise ValueError(f"row_sizes {list(row_sizes)} must split the {len(samples)} samples into rows of >= 1")
    sequences = [build_sequence(tokenizer, s, image_tokens) for s in samples]
    rows, start = [], 0
    for size in sizes:
        rows.append(sequences[start : start + size])
        start += size
    lengths = [sum(len(ids) for ids, _, _ in row) for row in rows]
    B, S = len(rows), max(lengths)
    input_ids_BS = torch.full((B, S), tokenizer.pad_id, dtype=torch.long)
    targets_BS = torch.full((B, S), IGNORE_INDEX, dtype=torch.long)
    documents_BS = torch.full((B, S), -1, dtype=torch.long)
    sample_positions_BS = torch.zeros((B, S), dtype=torch.long)
    image_positions: list[int] = []
    sample = 0
    for b, row in enumerate(rows):
        at = 0
        for ids, targets, positions in row:
            input_ids_BS[b, at : at + len(ids)] = torch.tensor(ids)
            targets_BS[b, at : at + len(ids)] = torch.tensor(targets)
            documents_BS[b, at : at + len(ids)] = sample
            sample_positions_BS[b, at : at + len(ids)] = torch.arange(len(ids))
            image_positions.extend(b * S + at + p for p in positions)
            at, sample = at + len(ids), sample + 1
    image_ids = tuple(i for s in samples for i in s.image_ids)
    grids = [image_tokens.token_grid(i) for i in image_ids]
    packed = bool(row_sizes)
    return Batch(
        input_ids=input_ids_BS,
        targets=targets_BS,
        image_positions=torch.tensor(image_positions, dtype=torch.long),
        image_ids=image_ids,
        lengths=torch.tensor(lengths, dtype=torch.long),
        n_targets=int((targets_BS != IGNORE_INDEX).sum()),
        image_grids=tuple(grids) if all(grids) else (),
        documents=documents_BS if packed else None,
        sample_positions=sample_positions_BS if packed else None,
    )
