"""Packing a microbatch's samples into LLM rows (`train.seq_len`), torch-free: the router plans
it, so that the boundary plan and the encoder balance see the packed rows, and every LLM rank
and the single-process reference build the same ones from the step command.

Rows are filled first fit, longest sample first: each sample goes into the first row with room
for it, else a new row. A row's samples keep their planned order; the rows are ordered by their
first sample. Each sample attends only to itself and its positions restart (the LLM's document
mask: `MoELM(documents_BS=, sample_positions_BS=)`), so a packed step's loss and gradients are
the unpacked step's.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Indices into `lengths` (each sample's tokens), in rows of at most `seq_len` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[index] > seq_len:
            raise ValueError(f"a sample of {lengths[index]} tokens does not fit a packed row of train.seq_len "
                             f"({seq_len}) tokens")
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if row is None:
            rows.append([])
            room.append(seq_len)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= lengths[index]
    return sorted((sorted(row) for row in rows), key=lambda row: row[0])
