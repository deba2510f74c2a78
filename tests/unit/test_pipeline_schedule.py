"""dyad.pipeline_schedule, walked without processes: every rank's actions run to the
end in some order that respects each rank's order and every dependency (sends never wait,
receives do), every forward and backward of every stage and microbatch exactly once, the messages
between two ranks received in the order they are sent, and 1F1B's bound on held activations; and
the exchanges the pipeline posts between steps, walked under NCCL's rule that a rank's
point-to-point operations run in the order it posts them."""

import re

import pytest

from dyad.pipeline_schedule import (
    Action,
    Exchange,
    Message,
    exchanges,
    first_stage_lead,
    forward_only,
    schedule,
    steps,
)

SHAPES = [(pp, chunks, m) for pp in (2, 3, 4, 8) for chunks in (1, 2, 3) for m in range(1, 17)
          if chunks == 1 or m % pp == 0]


def _walk(pp: int, chunks: int, actions: list[list[Action]], prefetch: int | None = None) -> bool:
    """Whether the ranks, each blocking only where an action waits for another rank's output,
    finish every action. `prefetch`: the first stage's inputs come from a producer that works
    that many microbatches ahead of the oldest whose gradient it has not got back (the encoder
    pool); None: they are there from the start."""
    stages, done, next_ = pp * chunks, set(), [0] * pp
    moved = True
    while moved:
        moved = False
        for rank in range(pp):
            while next_[rank] < len(actions[rank]):
                action = actions[rank][next_[rank]]
                stage = action.chunk * pp + rank
                if action.forward and stage == 0 and prefetch is not None:
                    oldest = next(m for m in range(action.microbatch + 1) if ("B", 0, m) not in done)
                    needs = None if action.microbatch < oldest + prefetch else ("B", 0, oldest)
                elif action.forward:
                    needs = None if stage == 0 else ("F", stage - 1, action.microbatch)
                else:
                    assert ("F", stage, action.microbatch) in done, "a backward before its forward"
                    needs = None if stage == stages - 1 else ("B", stage + 1, action.microbatch)
                if needs is not None and needs not in done:
                    break
                done.add(("F" if action.forward else "B", stage, action.microbatch))
                next_[rank] += 1
                moved = True
    return all(next_[rank] == len(actions[rank]) for rank in range(pp))


def _messages(pp: int, chunks: int, actions: list[list[Action]]) -> tuple[dict, dict]:
    """(rank, peer) -> the messages in the order the rank sends them, and in the order the peer
    receives them."""
    stages, sent, received = pp * chunks, {}, {}
    for rank in range(pp):
        for action in actions[rank]:
            stage, m = action.chunk * pp + rank, action.microbatch
            if action.forward and stage > 0:
                received.setdefault(((stage - 1) % pp, rank), []).append(("F", stage, m))
            if action.forward and stage < stages - 1:
                sent.setdefault((rank, (stage + 1) % pp), []).append(("F", stage + 1, m))
            if not action.forward and stage < stages - 1:
                received.setdefault(((stage + 1) % pp, rank), []).append(("B", stage, m))
            if not action.forward and stage > 0:
                sent.setdefault((rank, (stage - 1) % pp), []).append(("B", stage - 1, m))
    return sent, received


@pytest.mark.parametrize("pp, chunks, microbatches", SHAPES)
def test_a_step_runs_every_pass_once_without_deadlock(pp, chunks, microbatches):
    actions = [schedule(pp, rank, microbatches, chunks) for rank in range(pp)]
    for rank_actions in actions:
        expected = {Action(f, c, m) for f in (True, False) for c in range(chunks) for m in range(microbatches)}
        assert len(rank_actions) == len(expected) and set(rank_actions) == expected
    assert _walk(pp, chunks, actions)
    sent, received = _messages(pp, chunks, actions)
    assert sent == received  # also in order: what NCCL, whose receives match sends in order, needs


@pytest.mark.parametrize("pp, chunks, microbatches", SHAPES)
def test_inputs_produced_the_first_stage_lead_ahead_suffice_and_no_fewer(pp, chunks, microbatches):
    actions = [schedule(pp, rank, microbatches, chunks) for rank in range(pp)]
    lead = first_stage_lead(pp, microbatches, chunks)
    assert _walk(pp, chunks, actions, prefetch=lead)
    assert not _walk(pp, chunks, actions, prefetch=lead - 1)
    if chunks == 1:
        assert lead == min(pp, microbatches)


@pytest.mark.parametrize("pp, microbatches", [(2, 1), (2, 6), (4, 3), (4, 8), (8, 16)])
def test_1f1b_holds_at_most_pp_minus_rank_microbatches(pp, microbatches):
    for rank in range(pp):
        held, most = 0, 0
        for action in schedule(pp, rank, microbatches):
            held += 1 if action.forward else -1
            most = max(most, held)
        assert most == min(pp - rank, microbatches)


def test_interleaved_order_goes_in_rounds_of_pp():
    forwards = [(a.chunk, a.microbatch) for a in schedule(2, 0, 4, 2) if a.forward]
    assert forwards == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    backwards = [(a.chunk, a.microbatch) for a in schedule(2, 0, 4, 2) if not a.forward]
    assert backwards == [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]


def test_interleaved_refuses_microbatches_not_a_multiple_of_pp():
    message = "the interleaved schedule needs microbatches (3) to be a multiple of pp (2)"
    with pytest.raises(ValueError, match=re.escape(message)):
        schedule(2, 0, 3, 2)


@pytest.mark.parametrize("pp, chunks, microbatches", [(2, 1, 3), (4, 1, 2), (2, 2, 4), (4, 2, 1)])
def test_forward_only_runs_every_forward_once_without_deadlock(pp, chunks, microbatches):
    actions = [forward_only(pp, rank, microbatches, chunks) for rank in range(pp)]
    assert all(len(set(a)) == len(a) == microbatches * chunks for a in actions)
    assert _walk(pp, chunks, actions)
    sent, received = _messages(pp, chunks, actions)
    assert sent == received


def _in_posted_order(pp: int, groups: list[list[list[tuple[str, Message]]]]) -> bool:
    """Whether every rank gets through its posted groups under NCCL's rule: a rank runs its
    groups one after another; an operation of the group it runs finishes once its partner (a
    send's receive, a receive's send) is in the group its peer runs (a large message: nothing
    is buffered), and the next group starts when all of them have. Stricter than NCCL, which
    orders only a pair of ranks' operations, not a rank's with all of its peers."""
    heads, done = [0] * pp, set()
    moved = True
    while moved:
        moved = False
        for rank in range(pp):
            while heads[rank] < len(groups[rank]) and all(op in done for op in groups[rank][heads[rank]]):
                heads[rank] += 1  # an empty group posts nothing
                moved = True
            if heads[rank] == len(groups[rank]):
                continue
            for kind, message in groups[rank][heads[rank]]:
                peer = (message.dst if kind == "send" else message.src) % pp
                partner = ("recv" if kind == "send" else "send", message)
                if (kind, message) not in done and heads[peer] < len(groups[peer]) and partner in groups[peer][heads[peer]]:
                    done |= {(kind, message), partner}
                    moved = True
    return all(heads[rank] == len(groups[rank]) for rank in range(pp))


def _grouped(exchange: Exchange) -> list[list[tuple[str, Message]]]:
    return [[*(("send", m) for m in exchange.sends), *(("recv", m) for m in exchange.receives)]]


def _one_by_one(exchange: Exchange) -> list[list[tuple[str, Message]]]:
    """Each send alone, then each receive alone: each output posted as soon as it exists."""
    return [[("send", m)] for m in exchange.sends] + [[("recv", m)] for m in exchange.receives]


def _posted(pp, chunks, actions, group) -> list[list[list[tuple[str, Message]]]]:
    return [[ops for exchange in exchanges(pp, rank, actions[rank], chunks) for ops in group(exchange)]
            for rank in range(pp)]


@pytest.mark.parametrize("pp, chunks, microbatches", SHAPES)
def test_the_exchanges_finish_in_nccls_posted_order(pp, chunks, microbatches):
    """Each step's inputs received with the previous step's outputs sent, as one group: every
    schedule and every forward-only pass get through under NCCL's in-order rule, and every
    message is sent once and received once."""
    for actions in ([schedule(pp, rank, microbatches, chunks) for rank in range(pp)],
                    [forward_only(pp, rank, microbatches, chunks) for rank in range(pp)]):
        assert all([a for step in steps(actions[rank], chunks) for a in step] == actions[rank] for rank in range(pp))
        posted = _posted(pp, chunks, actions, _grouped)
        assert _in_posted_order(pp, posted), (pp, chunks, microbatches)
        ops = [op for rank in posted for group in rank for op in group]
        sends, receives = ([m for kind, m in ops if kind == wanted] for wanted in ("send", "recv"))
        assert len(set(sends)) == len(sends) and sorted(sends, key=repr) == sorted(receives, key=repr)


def test_each_output_sent_as_soon_as_it_exists_deadlocks_1f1b_under_nccl():
    """Why the exchanges group a send with the next receive: posted one by one, the first stage
    sends microbatch 1's activations before it takes microbatch 0's gradient, which the second
    stage sends before it takes microbatch 1's activations."""
    actions = [schedule(2, rank, 4) for rank in range(2)]
    assert not _in_posted_order(2, _posted(2, 1, actions, _one_by_one))
    assert _in_posted_order(2, _posted(2, 1, actions, _grouped))
