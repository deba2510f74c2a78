"""Qwen3-VL's multimodal rotary positions of a batch (transformers' `Qwen3VLMoeModel.get_rope_index`
for images): each token's (t, h, w), from its sample's runs of text and image tokens.

Text counts on from where the sample stands, the same position on all three axes. An image's run
of tokens (its patch grid after the spatial merge, row-major) takes t = start, h = start + row,
w = start + column, and the sample then stands at start + max(rows, columns): an image advances
the positions by its longer side, not by its token count. Padding (attention_mask 0) is skipped
and sits at 0 on every axis.

The LLM service owns it (torch, on the host): from the inputs transformers' processor gives
(`mm_token_type_ids` and `image_grid_thw`: `rope_index`), or from a collated batch, whose images
carry their grids of tokens (`batch_rope_positions`: what a run's LLM ranks and its single-process
reference compute).

Legend: B samples, S sequence, I images (in sample order, then placeholder order).
"""

from __future__ import annotations

import itertools
import math

import torch

from dyad.data.batch import Batch

TEXT, IMAGE = 0, 1  # mm_token_type_ids' values (transformers' processors'; 2, a video's, not taken)


def rope_index(
    mm_token_type_ids_BS: torch.Tensor,
    image_grid_thw_I3: torch.Tensor | None = None,
    attention_mask_BS: torch.Tensor | None = None,
    *,
    spatial_merge_size: int,
) -> torch.Tensor:
    """[3, B, S] long (t, h, w): the rotary positions of each token. image_grid_thw_I3: each
    image's patch grid before the merge (as the image processor gives it), in the order of the
    image runs of the batch; each run must hold its image's t·(h/m)·(w/m) tokens."""
    B, S = mm_token_type_ids_BS.shape
    positions_3BS = torch.zeros(3, B, S, dtype=torch.long)
    grids = [] if image_grid_thw_I3 is None else [tuple(g) for g in image_grid_thw_I3.tolist()]
    images = iter(range(len(grids)))
    for b in range(B):
        real_S = torch.ones(S, dtype=torch.bool) if attention_mask_BS is None else attention_mask_BS[b].bool().cpu()
        pieces, start = [], 0
        for kind, run in itertools.groupby(mm_token_type_ids_BS[b].cpu()[real_S].tolist()):
            n = len(list(run))
            if kind == TEXT:
                pieces.append(torch.arange(start, start + n).expand(3, n))
                start += n
            elif kind == IMAGE:
                i = next(images, None)
                if i is None:
                    raise ValueError(f"mm_token_type_ids hold more image runs than image_grid_thw's {len(grids)} images")
                positions_3N, advance = _image_positions(start, grids[i], spatial_merge_size, n, i)
                pieces.append(positions_3N)
                start += advance
            else:
                raise ValueError(f"mm_token_type_ids value {kind}: only text (0) and images (1) are taken")
        if pieces:
            positions_3BS[:, b, real_S] = torch.cat(pieces, dim=1)
    unused = next(images, None)
    if unused is not None:
        raise ValueError(f"image_grid_thw has {len(grids)} images, mm_token_type_ids only {unused} image runs")
    return positions_3BS


def batch_rope_positions(batch: Batch) -> torch.Tensor:
    """[3, B, S] long: the rotary positions of a collated batch (on the host), its images' tokens
    where `batch.image_positions` puts them, each image's grid of tokens `batch.image_grids`
    (already merged). The same as `rope_index` of each sample's tokens where text separates its
    images; two images side by side each start where the one before ended (`rope_index` would
    see one run). Each sample of a packed row counts from 0 as it would alone. Padding sits at 0."""
    if batch.image_ids and not batch.image_grids:
        raise ValueError("multimodal rotary positions need each image's grid of tokens; this batch's images have none "
                         "(a native-resolution tower gives them)")
    B, S = batch.input_ids.shape
    firsts = batch.image_positions.cpu().tolist()
    images_of: list[list[tuple[int, tuple[int, int, int]]]] = [[] for _ in range(B)]  # (first column, grid)
    row = 0
    for grid in batch.image_grids:
        b, column = divmod(firsts[row], S)
        images_of[b].append((column, grid))
        row += math.prod(grid)
    positions_3BS = torch.zeros(3, B, S, dtype=torch.long)
    for b, length in enumerate(batch.lengths.tolist()):
        for begin, end in _sample_spans(batch, b, length):
            images = [(first - begin, grid) for first, grid in images_of[b] if begin <= first < end]
            positions_3BS[:, b, begin:end] = _sequence_positions(end - begin, images)
    return positions_3BS


def _sample_spans(batch: Batch, b: int, length: int) -> list[tuple[int, int]]:
    """[begin, end) columns of each sample of row b: the row's real columns, or each packed sample's."""
    if batch.documents is None:
        return [(0, length)]
    documents = batch.documents[b, :length].cpu()
    starts = [0, *(torch.nonzero(documents[1:] != documents[:-1]).squeeze(1) + 1).tolist()]
    return list(zip(starts, [*starts[1:], length]))


def _sequence_positions(length: int, images: list[tuple[int, tuple[int, int, int]]]) -> torch.Tensor:
    """[3, length]: one sequence's positions, its images (first column, merged grid) in order."""
    pieces, start, column = [], 0, 0
    for i, (first, grid) in enumerate(images):
        pieces.append(torch.arange(start, start + first - column).expand(3, first - column))
        start += first - column
        positions_3N, advance = _image_positions(start, grid, 1, math.prod(grid), i)
        pieces.append(positions_3N)
        start, column = start + advance, first + math.prod(grid)
    pieces.append(torch.arange(start, start + length - column).expand(3, length - column))
    return torch.cat(pieces, dim=1)


def _image_positions(start: int, grid: tuple[int, int, int], merge: int, n: int, i: int) -> tuple[torch.Tensor, int]:
    """[3, n] positions of image i's run of n tokens, its grid (t, h, w) merged by `merge` along
    h and w; and how far the image advances the sample's position."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    if t * h * w != n:
        raise ValueError(f"image {i}: a run of {n} image tokens, its grid {list(grid)} merged by {merge} gives {t * h * w}")
    t_THW, h_THW, w_THW = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([t_THW, h_THW, w_THW]).reshape(3, n) + start, max(h, w)
