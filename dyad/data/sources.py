"""Where conversation records come from (`data.path`, for `data.name: conversations`), chosen by
what the path names:

- a JSONL file: one record per line, images as paths beside it (`JsonlRecords`, below);
- a `.json` file: a list of records, as LLaVA ships its data (`LlavaJson`, below);
- `.tar` files: WebDataset shards, a record and its images per sample key (`dyad/data/shards.py`);
- `.parquet` files, or a directory `datasets.Dataset.save_to_disk` wrote: a record per row, images
  as bytes in the table or as paths (`dyad/data/tables.py`, through the `datasets` library).

`data.path` may be a brace pattern (`shards/train-{000000..000099}.tar`, `{a,b}.parquet`) and
a glob (`train-*.parquet`); each expansion's matches are taken sorted, in the order of the
expansions. Records are numbered in that order, which is what makes sample ids stable across
loads of the same files: the sampler's exactly-once resume relies on it.

A source yields a `RawRecord` per record: the JSON object, its images' locators (hashable: the same
image once in the dataset's image table) and the problems found reading it, named by `where`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from glob import glob, has_magic
from pathlib import Path

from braceexpand import braceexpand

from dyad.data.jsonl import json_object
from dyad.data.raw_records import FIELD, RawRecord, RecordSource
from dyad.data.shards import TarShards
from dyad.data.tables import Tables


def expand(pattern: str) -> list[Path]:
    """The files `pattern` names: itself where it exists, else its brace expansions, each globbed
    (matches sorted); a ValueError naming data.path where one names nothing."""
    if Path(pattern).exists():
        return [Path(pattern)]
    files: dict[Path, None] = {}  # ordered, without repeats
    for expansion in braceexpand(pattern):
        matches = sorted(glob(expansion)) if has_magic(expansion) else [expansion] if Path(expansion).exists() else []
        if not matches:
            raise ValueError(f"{FIELD}: no file matches '{expansion}'" if expansion != pattern else
                             f"{FIELD}: file not found: '{pattern}'")
        files.update(dict.fromkeys(Path(m) for m in matches))
    return list(files)


def open_source(pattern: str) -> RecordSource:
    """The source of `data.path`'s records, by what it names (the module docstring)."""
    files = expand(pattern)
    suffixes = {f.suffix if f.is_file() else "a directory" for f in files}
    if suffixes == {".tar"}:
        return TarShards(files)
    if suffixes == {".parquet"} or (len(files) == 1 and files[0].is_dir()):
        return Tables(files)
    if suffixes == {".json"} and len(files) == 1:
        return LlavaJson(files[0])
    if len(files) == 1:
        return JsonlRecords(files[0])
    raise ValueError(f"{FIELD}: '{pattern}' names {len(files)} files, not all .tar shards nor all .parquet files "
                     f"({', '.join(sorted(suffixes))}); one JSONL or JSON file, tar shards or Parquet files are read")


class JsonlRecords:
    """One JSON object per line, in UTF-8 (blank lines skipped); "images" (required): image paths,
    relative to the file's directory or absolute."""

    def __init__(self, path: Path):
        self.path = path

    def records(self) -> Iterator[RawRecord]:
        # Bytes: a line that is not UTF-8 is one record's problem, named by its line.
        for line_no, line in enumerate(self.path.read_bytes().splitlines(), start=1):
            if line.strip():
                yield self._record(f"{self.path}:{line_no}", line)

    def _record(self, where: str, line: bytes) -> RawRecord:
        record, problem = json_object(line)
        if problem:
            return RawRecord(where, None, problems=(problem,))
        images = record.get("images")
        if images is None:
            return RawRecord(where, record, problems=("a record needs 'images': its image paths, [] for none",))
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            return RawRecord(where, record, problems=("'images' must be a list of strings",))
        return RawRecord(where, record, tuple((name, (self.path.parent / name).resolve()) for name in images))

    def open(self, locator: Path) -> Path:
        return locator


class LlavaJson(JsonlRecords):
    """A JSON list of records in one file, as LLaVA ships its data (llava_v1_5_mix665k.json):
    "image" one path, or a list of them (LLaVA-NeXT's several), or absent for a text-only record;
    or "images" a list, as in JSONL. Paths are relative to the file's directory or absolute.
    Records are named "<file>:record <n>", n counting from 0 as the list's indices do."""

    def records(self) -> Iterator[RawRecord]:
        try:
            records = json.loads(self.path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            yield RawRecord(str(self.path), None, problems=(f"not a JSON file: {e}",))
            return
        if not isinstance(records, list):
            yield RawRecord(str(self.path), None, problems=(f"holds a {type(records).__name__}, not a list of records",))
            return
        for n, record in enumerate(records):
            yield self._record(f"{self.path}:record {n}", record)

    def _record(self, where: str, record) -> RawRecord:
        if not isinstance(record, dict):
            return RawRecord(where, None, problems=(f"a record must be a JSON object, got {type(record).__name__}",))
        if "image" in record and "images" in record:
            return RawRecord(where, record, problems=("a record has 'image' (LLaVA's) or 'images', not both",))
        key = "images" if "images" in record else "image"
        images = record.get(key, [])
        images = [images] if isinstance(images, str) else images
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            return RawRecord(where, record, problems=(f"'{key}' must be a path or a list of paths",))
        return RawRecord(where, record, tuple((name, (self.path.parent / name).resolve()) for name in images))
