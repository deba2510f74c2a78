"""Cutting a sequence into consecutive runs bounded in bytes: what a checkpoint loads at once,
what one gradient all-reduce sums."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def byte_runs(
    items: Iterable[T],
    nbytes: Callable[[T], int],
    limit: int,
    kind: Callable[[T], Hashable] = lambda item: None,
) -> Iterator[list[T]]:
    """`items` in order, cut into runs of one `kind` whose `nbytes` total at most `limit`; an
    item larger than `limit` is a run of its own."""
    run, size = [], 0
    for item in items:
        n = nbytes(item)
        if run and (size + n > limit or kind(item) != kind(run[0])):
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run
