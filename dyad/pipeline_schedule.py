"""Pipeline schedules as the list of actions each pipeline rank takes, pure math (no torch): the
router's config checks read them as the workers' pipelines (`dyad.parallel.pipeline`) run them.

The 1F1B schedule and its interleaved form (each rank holding several chunks of layers, "virtual
stages"), as Megatron-LM orders them; and forward passes only, for an evaluation. Stage s is
chunk s // pp of pipeline rank s % pp (`dyad.layout.LLMLayout.rank_stages`); its forward of a
microbatch needs stage s - 1's, its backward stage s + 1's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    forward: bool  # False: the backward pass
    chunk: int  # which of the rank's chunks of layers
    microbatch: int


def schedule(pp: int, pp_rank: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """Pipeline rank `pp_rank`'s actions for a training step: warm-up forwards, then one forward
    and one backward in turn, then the remaining backwards. One chunk: 1F1B, at most pp - pp_rank
    microbatches' activations held at once. Several: the interleaved 1F1B, which cuts the
    pipeline's idle time by the chunks and needs `microbatches` to be a multiple of pp (it runs
    them in rounds of pp through each chunk in turn)."""
    total = microbatches * chunks
    if chunks == 1:
        warmup = min(pp - pp_rank - 1, microbatches)
    else:
        if microbatches % pp:
            raise ValueError(f"the interleaved schedule needs microbatches ({microbatches}) to be a multiple of pp ({pp})")
        warmup = min((pp - pp_rank - 1) * 2 + (chunks - 1) * pp, total)
    forwards = [Action(True, *_chunk_and_microbatch(k, pp, chunks, backward=False)) for k in range(total)]
    backwards = [Action(False, *_chunk_and_microbatch(k, pp, chunks, backward=True)) for k in range(total)]
    actions = forwards[:warmup]
    for k in range(total - warmup):
        actions += [forwards[warmup + k], backwards[k]]
    return actions + backwards[total - warmup :]


def forward_only(pp: int, pp_rank: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """Forward passes only (an evaluation): each microbatch through the rank's chunks in turn."""
    return [Action(True, chunk, m) for m in range(microbatches) for chunk in range(chunks)]


def first_stage_lead(pp: int, microbatches: int, chunks: int = 1) -> int:
    """The most microbatches whose inputs the first stage has taken, under `schedule`, beyond
    those whose input gradients it has returned: a producer of its inputs that waits for the
    gradient of its oldest must work this far ahead (1F1B: pp, or the microbatches if fewer)."""
    taken = returned = lead = 0
    for action in schedule(pp, 0, microbatches, chunks):
        if action.chunk != 0:
            continue
        if action.forward:
            taken += 1
            lead = max(lead, taken - returned)
        else:
            returned += 1
    return lead


def live_passes(pp: int, pp_rank: int, microbatches: int, chunks: int = 1) -> int:
    """The most forward passes (of one chunk and microbatch each) rank `pp_rank` has run, under
    `schedule`, whose backward it has not: how many passes' activations it keeps at once."""
    live = most = 0
    for action in schedule(pp, pp_rank, microbatches, chunks):
        live += 1 if action.forward else -1
        most = max(most, live)
    return most


def _chunk_and_microbatch(k: int, pp: int, chunks: int, backward: bool) -> tuple[int, int]:
    """The k-th forward (or backward) of a rank: in rounds of pp microbatches, each round through
    the chunks in order (backward: in reverse)."""
    if chunks == 1:
        return 0, k
    round_, within = divmod(k, pp * chunks)
    chunk = within // pp
    return (chunks - 1 - chunk if backward else chunk), round_ * pp + within % pp
