"""Pipeline schedules as the list of actions each pipeline rank takes, pure math (no torch): the
router's config checks read them as the workers' pipelines (`dyad.parallel.pipeline`) run them.

The 1F1B schedule and its interleaved form (each rank holding several chunks of layers, "virtual
stages"), as Megatron-LM orders them; and forward passes only, for an evaluation. Stage s is
chunk s // pp of pipeline rank s % pp (`dyad.layout.LLMLayout.rank_stages`); its forward of a
microbatch needs stage s - 1's, its backward stage s + 1's.

`exchanges` says what a rank posts to its neighbours, and together with what: before each action
its input's receive, and with it the previous action's output, whose send waits until then. NCCL
runs a pair of ranks' point-to-point operations in the order each posts them and a large send
finishes only once its receive runs, so two neighbours that each post a send before the receive
that matches the other's send wait for each other for ever (1F1B does that: the first stage sends
microbatch 1's activations before it takes microbatch 0's gradient, which the second stage sends
before it takes microbatch 1's activations). Posted as one group, a send and a receive run at
once (as Megatron-LM's `send_forward_recv_backward`).
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


@dataclass(frozen=True)
class Message:
    """A tensor between neighbouring stages for `microbatch`: stage `src`'s output into stage
    `dst` = src + 1 (forward), or the gradient of stage `dst`'s output from stage `src` = dst + 1."""

    src: int
    dst: int
    microbatch: int
    forward: bool


@dataclass(frozen=True)
class Exchange:
    """What a rank posts as one group, before a step of its actions (or after the last): the
    previous step's outputs sent and this step's inputs received, in the step's order."""

    sends: tuple[Message, ...]
    receives: tuple[Message, ...]


def steps(actions: list[Action], chunks: int = 1) -> list[list[Action]]:
    """`actions` (a `schedule` or `forward_only`) in the steps a rank exchanges between: one
    action a step; interleaved (`chunks` > 1), each forward of the steady phase and the backward
    after it together, as Megatron-LM's interleaved schedule sends and receives both passes'
    tensors at once (the warm-up's forwards and the cool-down's backwards one a step)."""
    total = sum(action.forward for action in actions)
    leading = next((i for i, action in enumerate(actions) if not action.forward), len(actions))
    warmup = total if chunks == 1 or leading == total else leading - 1
    steady = range(warmup, warmup + 2 * (total - warmup), 2)
    grouped, index = [], 0
    while index < len(actions):
        size = 2 if index in steady else 1
        grouped.append(actions[index : index + size])
        index += size
    return grouped


def exchanges(pp: int, pp_rank: int, actions: list[Action], chunks: int = 1) -> list[Exchange]:
    """Rank `pp_rank`'s exchanges for `actions` (its `schedule` or `forward_only`): the i-th is
    posted before the i-th of its `steps`, the last one after the last step (its outputs' sends)."""
    stages = pp * chunks
    posted, pending = [], ()
    for step in steps(actions, chunks):
        receives, outputs = [], []
        for action in step:
            stage, m = action.chunk * pp + pp_rank, action.microbatch
            if action.forward:
                receives += [Message(stage - 1, stage, m, True)] if stage > 0 else []
                outputs += [Message(stage, stage + 1, m, True)] if stage < stages - 1 else []
            else:
                receives += [Message(stage + 1, stage, m, False)] if stage < stages - 1 else []
                outputs += [Message(stage, stage - 1, m, False)] if stage > 0 else []
        posted.append(Exchange(pending, tuple(receives)))
        pending = tuple(outputs)
    return [*posted, Exchange(pending, ())]


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
