"""Conversation records in WebDataset tar shards: `data.path: "shards/train-{000000..000099}.tar"`.

The layout is webdataset's: a shard is a tar file whose members are grouped into samples by key, a
member's key being its path up to the first dot of its file name and the rest its extension
(`images/000123.0.png`: key `images/000123`, extension `0.png`). Per key in a shard:

- `<key>.json`: the record, as `dyad/data/conversations.py` describes it ("conversations" or
  "messages", optional "split"), whose "images" are optional and name the key's image members by
  extension, in the order of the `<image>` placeholders: `["jpg"]`, `["0.png", "1.png"]`;
- without "images", the sample's images are all of the key's members whose extension ends in an
  image format (`IMAGE_EXTENSIONS`), ordered by extension with numbers compared as numbers
  (`0.jpg`, `1.jpg`, ..., `10.jpg`); `<key>.jpg` alone is the one image of a LLaVA-style sample;
- other members (`.txt`, `.cls`, ...) are ignored, as are members that are not files or have no
  extension.

Shards must be uncompressed tar files: loading reads each once (the records, every image decoded
once to validate it) and keeps only an index, (shard, offset, size) per image; an image is read
by seeking to its bytes. Samples are numbered by shard (in `data.path`'s order), then by where
each key first appears in its shard. Bad samples are reported as "<shard>:<key>: <problem>".
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dyad.data.jsonl import json_object
from dyad.data.raw_records import FIELD, RawRecord

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm")
_KEY_EXTENSION = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's `base_plus_ext`


@dataclass(frozen=True)
class Member:
    """Where a member's bytes lie: an image's locator."""

    shard: Path
    offset: int
    size: int

    def read(self) -> bytes:
        with open(self.shard, "rb") as file:
            file.seek(self.offset)
            return file.read(self.size)


def _natural(extension: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", extension)]


def _image_extensions(members: dict[str, Member]) -> list[str]:
    return sorted((e for e in members if e.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS), key=_natural)


class TarShards:
    def __init__(self, shards: list[Path]):
        self.shards = shards

    def records(self) -> Iterator[RawRecord]:
        for shard in self.shards:
            for key, (members, problems) in _index(shard).items():
                yield _record(f"{shard}:{key}", key, members, problems)

    def open(self, locator: Member) -> io.BytesIO:
        return io.BytesIO(locator.read())


def _index(shard: Path) -> dict[str, tuple[dict[str, Member], list[str]]]:
    """Each key's members by extension (in the shard's order) and the problems of its members."""
    samples: dict[str, tuple[dict[str, Member], list[str]]] = {}
    try:
        # "r:": uncompressed only, since images are read by offset
        with tarfile.open(shard, "r:") as tar:
            for info in tar:  # reads the headers, seeking past the data
                match = _KEY_EXTENSION.match(info.name) if info.isfile() else None
                if match is None:
                    continue
                key, extension = match.groups()
                members, problems = samples.setdefault(key, ({}, []))
                if extension in members:
                    problems.append(f"member {info.name!r} appears twice")
                members[extension] = Member(shard, info.offset_data, info.size)
    except (tarfile.TarError, OSError) as e:
        raise ValueError(f"{FIELD}: {shard} is not an uncompressed tar file: {e}") from None
    return samples


def _record(where: str, key: str, members: dict[str, Member], problems: list[str]) -> RawRecord:
    if "json" not in members:
        return RawRecord(where, None, problems=(*problems, f"no {key}.json: a sample needs its record"))
    record, problem = json_object(members["json"].read())
    if problem:
        return RawRecord(where, None, problems=(*problems, f"{key}.json: {problem}"))
    extensions = record.get("images", _image_extensions(members))
    if not isinstance(extensions, list) or not all(isinstance(e, str) for e in extensions):
        problems.append("'images' must be a list of the sample's image members by extension, e.g. [\"jpg\"]")
        extensions = []
    images = tuple((f"{key}.{e}", members.get(e)) for e in extensions)
    return RawRecord(where, record, images, tuple(problems))
