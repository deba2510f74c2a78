"""Conversation records in Parquet files or an Arrow dataset, read with Hugging Face's `datasets`
(the optional extra `pip install 'dyad[parquet]'`): `data.path: "train-*.parquet"` (each file
loaded with `Dataset.from_parquet`, which converts it once into the `datasets` cache,
`HF_DATASETS_CACHE`), or a directory `Dataset.save_to_disk` wrote (`load_from_disk`, memory-mapped
in place).

A row is a record: the columns "conversations" (LLaVA) or "messages" (OpenAI) and optionally
"split", as `dyad/data/conversations.py` describes them (a null cell is an absent field), and its
images in a column "images" (a list per row) or "image" (one per row, null for none). An image is
what the `datasets` Image feature stores, {"bytes": ..., "path": ...} (the bytes, or where they
are null the path), plain bytes, or a path string; a path is relative to the file's directory (the
Arrow directory's) or absolute. Images stay in the table: one is read by its row when it is used.
Rows are samples in file order, then row order. Bad rows are reported as "<file>:row <n>:
<problem>", n counting from 0 in each file as pandas and pyarrow do.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dyad.data.raw_records import FIELD, RawRecord

RECORD_COLUMNS = ("conversations", "messages", "split")
IMAGE_COLUMNS = ("images", "image")
BATCH_ROWS = 256


@dataclass(frozen=True)
class Cell:
    """An image's bytes in a table: its locator."""

    table: int  # index into Tables' tables
    row: int
    column: str
    index: int  # in the row's list of images (0 for the "image" column)


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{FIELD} names Parquet or Arrow data, which dyad reads with the `datasets` library: "
                         "pip install 'dyad[parquet]'") from None
    return datasets


def _load(path: Path):
    datasets = _datasets()
    if path.is_file():
        return datasets.Dataset.from_parquet(str(path))
    try:
        table = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(f"{FIELD}: {path} is not a directory `Dataset.save_to_disk` wrote: {e}") from None
    if isinstance(table, datasets.DatasetDict):
        raise ValueError(f"{FIELD}: {path} holds the splits {sorted(table)}; name one split's directory")  # noqa: TRY004
    return table


class Tables:
    def __init__(self, paths: list[Path]):
        self.paths = paths
        self._tables = [_load(path).with_format("arrow") for path in paths]  # arrow: cells as stored
        for path, table in zip(paths, self._tables):
            if all(c in table.column_names for c in IMAGE_COLUMNS):
                raise ValueError(f"{FIELD}: {path} has both an 'images' and an 'image' column; one holds the images")

    def records(self) -> Iterator[RawRecord]:
        for t, (path, table) in enumerate(zip(self.paths, self._tables)):
            column = next((c for c in IMAGE_COLUMNS if c in table.column_names), None)
            selected = table.select_columns([c for c in (*RECORD_COLUMNS, column) if c in table.column_names])
            for start in range(0, len(table), BATCH_ROWS):
                rows = selected[start : start + BATCH_ROWS].to_pylist()
                for row_no, row in enumerate(rows, start=start):
                    yield self._record(f"{path}:row {row_no}", Cell(t, row_no, column, 0), row)

    def _record(self, where: str, cell: Cell, row: dict) -> RawRecord:
        record = {k: row[k] for k in RECORD_COLUMNS if row.get(k) is not None}
        stored = row.get(cell.column)
        stored = [] if stored is None else [stored] if cell.column == "image" else stored
        images, problems = [], []
        for k, image in enumerate(stored):
            name = f"{cell.column}[{k}]" if cell.column == "images" else "image"
            if isinstance(image, dict):
                image = image.get("bytes") if image.get("bytes") is not None else image.get("path")
            if isinstance(image, bytes):
                images.append((name, Cell(cell.table, cell.row, cell.column, k)))
            elif isinstance(image, str):  # named by its path, as JSONL's are
                images.append((image, self._root(cell.table).joinpath(image).resolve()))
            else:
                problems.append(f"{name} must be bytes, a path or {{\"bytes\": ..., \"path\": ...}}")
        return RawRecord(where, record, tuple(images), tuple(problems))

    def _root(self, table: int) -> Path:
        path = self.paths[table]
        return path.parent if path.is_file() else path

    def open(self, locator: Cell | Path) -> io.BytesIO | Path:
        if isinstance(locator, Path):
            return locator
        row = self._tables[locator.table][locator.row : locator.row + 1].column(locator.column)[0].as_py()
        image = row if locator.column == "image" else row[locator.index]
        return io.BytesIO(image["bytes"] if isinstance(image, dict) else image)
