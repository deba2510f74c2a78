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

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return Batch(
            input_ids=move(self.input_ids),
            targets=move(self.targets),
            image_positions=move(self.image_positions),
            image_ids=self.image_ids,
            lengths=move(self.lengths),
            n_targets=self.n_targets,
            image_grids=self.image_grids,
        )


def collate(tokenizer: TextTokenizer, samples: Sequence[Sample], image_tokens: ImageTokens) -> Batch:
    """Right-pads the samples' sequences into one batch. Row k of the encoder output for
    `image_ids` (each image's `image_tokens` rows, one image after another: [N, D]) belongs at
    `image_positions[k]`."""
    assert samples, "collate needs at least one sample"
    sequences = [build_sequence(tokenizer, s, image_tokens) for s in samples]
    S = max(len(ids) for ids, _, _ in sequences)
    input_ids_BS = torch.full((len(samples), S), tokenizer.pad_id, dtype=torch.long)
    targets_BS = torch.full((len(samples), S), IGNORE_INDEX, dtype=torch.long)
    image_positions: list[int] = []
    image_ids = tuple(i for s in samples for i in s.image_ids)
    grids = [image_tokens.token_grid(i) for i in image_ids]
    for b, (ids, targets, positions) in enumerate(sequences):
        input_ids_BS[b, : len(ids)] = torch.tensor(ids)
        targets_BS[b, : len(ids)] = torch.tensor(targets)
        image_positions.extend(b * S + p for p in positions)
    return Batch(
        input_ids=input_ids_BS,
        targets=targets_BS,
        image_positions=torch.tensor(image_positions, dtype=torch.long),
        image_ids=image_ids,
        lengths=torch.tensor([len(ids) for ids, _, _ in sequences], dtype=torch.long),
        n_targets=int((targets_BS != IGNORE_INDEX).sum()),
        image_grids=tuple(grids) if all(grids) else (),
    )
