"""The boundary plan: which encoder rows go to which LLM rank, for every microbatch.

A pure function of the step's samples and the two layouts: no tensors, no sockets. This is the
simplest correct delivery: each microbatch is encoded by one encoder data-parallel group
(round-robin) and leaves from its tp rank 0; every rank of the consuming LLM data-parallel group
(all its tp × cp ranks) receives all of the microbatch's rows; the tp-rank-0 receivers return
gradients (each holds its context shard's share, the encoder sums them). The minimal transfer
(each rank only its own rows, encoder load balancing) replaces `plan_boundary` without changing
its inputs or the plan's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from dyad.layout import EncoderLayout, LLMLayout


@dataclass(frozen=True)
class Transfer:
    src_rank: int  # encoder rank
    dst_rank: int  # LLM rank
    microbatch: int
    image_ids: tuple[int, ...]  # in the order the receiver splices them
    rows: int
    returns_gradient: bool  # the receiver sends these rows' gradient back


@dataclass(frozen=True)
class BoundaryPlan:
    tokens_per_image: int
    hidden: int
    transfers: tuple[Transfer, ...]

    def bytes_forward(self, element_size: int) -> int:
        return sum(t.rows for t in self.transfers) * self.hidden * element_size


def plan_boundary(
    microbatches: Sequence[Sequence[int]],
    llm_dp_ranks: Sequence[int],
    images_of: Mapping[int, Sequence[int]],
    *,
    tokens_per_image: int,
    hidden: int,
    encoder: EncoderLayout,
    llm: LLMLayout,
) -> BoundaryPlan:
    """`images_of[sample_id]` lists the sample's image ids in placeholder order;
    `llm_dp_ranks[i]` is the LLM data-parallel rank that trains on microbatch i."""
    transfers = []
    for index, (sample_ids, dp_rank) in enumerate(zip(microbatches, llm_dp_ranks)):
        image_ids = tuple(i for s in sample_ids for i in images_of[s])
        if not image_ids:  # a text-only microbatch needs nothing from the encoder
            continue
        source = encoder.rank(tp=0, dp=index % encoder.dp)
        for cp in range(llm.cp):
            for tp in range(llm.tp):
                transfers.append(
                    Transfer(
                        src_rank=source,
                        dst_rank=llm.rank(tp=tp, cp=cp, dp=dp_rank),
                        microbatch=index,
                        image_ids=image_ids,
                        rows=len(image_ids) * tokens_per_image,
                        returns_gradient=tp == 0,
                    )
                )
    return BoundaryPlan(tokens_per_image, hidden, tuple(transfers))
