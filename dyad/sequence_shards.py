"""Which positions of a microbatch's sequence an LLM rank holds: the one home of the shard
geometry. The router plans the boundary with it; the LLM shards its microbatches with it.

The sequence is padded (after every real token) to a multiple of 2·cp·tp under context
parallelism, else of tp, so that every context shard splits evenly over tp: sequence parallelism
cuts a shard's local columns into tp equal contiguous parts, and the MoE layers split its tokens
likewise. Context parallelism cuts the padded sequence into 2·cp equal chunks; cp rank r holds
chunks r and 2·cp-1-r ("zig-zag"), so every rank gets the same amount of causal-attention work.
Ranks that differ only in tp hold the same positions.

Plain ints and ranges, no torch: the router imports it, torch callers wrap the ranges in tensors.
"""

from __future__ import annotations

from typing import NamedTuple


class SequenceShard(NamedTuple):
    padded_len: int  # the microbatch's padded sequence, the same for every rank
    spans: tuple[range, ...]  # the positions held, ascending: concatenated, the local columns


def sequence_shard(seq_len: int, *, cp: int, tp: int, cp_rank: int) -> SequenceShard:
    """The padded length of a microbatch whose longest sequence is `seq_len`, and the positions
    `cp_rank` holds: all of them without context parallelism, else chunks `cp_rank` and
    `2·cp-1-cp_rank` of `2·cp`."""
    if cp == 1:
        padded_len = -(-seq_len // tp) * tp
        return SequenceShard(padded_len, (range(padded_len),))
    chunks = 2 * cp
    padded_len = -(-seq_len // (chunks * tp)) * chunks * tp
    chunk = padded_len // chunks
    held = (cp_rank, chunks - 1 - cp_rank)
    return SequenceShard(padded_len, tuple(range(c * chunk, (c + 1) * chunk) for c in held))
