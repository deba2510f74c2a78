"""What every source of conversation records yields (`dyad/data/sources.py` chooses the source):
a `RawRecord` per record, and the `RecordSource` protocol the sources share."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

FIELD = "data.path"


@dataclass(frozen=True)
class RawRecord:
    where: str  # how a problem names the record: "<file>:<line>", "<shard>:<key>", "<file>:row <n>"
    record: dict | None  # None where it could not be read (`problems` say why)
    # (the name a problem calls it, its locator; None where it is missing), in placeholder order
    images: tuple[tuple[str, Hashable | None], ...] = ()
    problems: tuple[str, ...] = ()


class RecordSource(Protocol):
    def records(self) -> Iterator[RawRecord]:
        """Every record, in the order that numbers the samples."""

    def open(self, locator: Hashable) -> Path | BinaryIO:
        """An image's file, or its bytes as an open binary file: what Pillow opens."""
