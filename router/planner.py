"""The boundary plan: which encoder rows go to which LLM rank, for every microbatch.

A pure function of the step's samples and the two layouts: no tensors, no sockets. This release
plans for one encoder rank and one LLM rank; the general, minimal layout transform replaces
`plan_boundary` without changing its inputs or the plan's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from dyad.layout import EncoderLayout, LLMLayout, check_executable


@dataclass(frozen=True)
class Transfer:
    src_rank: int  # encoder rank
    dst_rank: int  # LLM rank
    microbatch: int
    image_ids: tuple[int, ...]  # in the order the receiver splices them
    rows: int


@dataclass(frozen=True)
class BoundaryPlan:
    tokens_per_image: int
    hidden: int
    transfers: tuple[Transfer, ...]

    def sent_by(self, src_rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src_rank == src_rank]

    def received_by(self, dst_rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst_rank == dst_rank]

    def bytes_forward(self, element_size: int) -> int:
        return sum(t.rows for t in self.transfers) * self.hidden * element_size


def plan_boundary(
    microbatches: Sequence[Sequence[int]],
    images_of: Mapping[int, Sequence[int]],
    *,
    tokens_per_image: int,
    hidden: int,
    encoder: EncoderLayout,
    llm: LLMLayout,
) -> BoundaryPlan:
    """Plan the step. `images_of[sample_id]` lists the sample's image ids in placeholder order."""
    check_executable(encoder, llm)
    transfers = []
    for index, sample_ids in enumerate(microbatches):
        image_ids = tuple(i for s in sample_ids for i in images_of[s])
        if image_ids:  # a text-only microbatch needs nothing from the encoder
            rows = len(image_ids) * tokens_per_image
            transfers.append(Transfer(0, 0, index, image_ids, rows))
    return BoundaryPlan(tokens_per_image, hidden, tuple(transfers))
