"""Source formats: the raw records of a JSONL file (plain or gzip) or a Parquet file.

The format is read from the file's first bytes, not its name. A JSONL line
that is not UTF-8 or not JSON becomes a :class:`RawRecord` carrying the
reason, so the loader reports it with its line number; a Parquet file that
cannot be read is a :class:`TaskFileError` for the file as a whole.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producers.loaders.errors import TaskFileError


@dataclass(frozen=True)
class RawRecord:
    """A source record, or why it could not even be parsed."""

    line: int | None
    row: int | None
    record: Any = None
    error: str | None = None


def _is_parquet(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"PAR1"


def _is_gzip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _jsonl_records(path: Path) -> Iterator[RawRecord]:
    opener = gzip.open if _is_gzip(path) else open
    with opener(path, "rb") as f:  # type: ignore[operator]
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RawRecord(n, None, error=f"not UTF-8 text: {exc.reason} at byte {exc.start}")
                continue
            if not text.strip():
                continue
            try:
                yield RawRecord(n, None, record=json.loads(text))
            except json.JSONDecodeError as exc:
                yield RawRecord(n, None, error=f"invalid JSON: {exc.msg} (column {exc.colno})")


def _parquet_records(path: Path, batch_rows: int) -> Iterator[RawRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        row = 0
        for batch in pf.iter_batches(batch_size=batch_rows):
            for record in batch.to_pylist():
                yield RawRecord(None, row, record=record)
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise TaskFileError(f"{path}: cannot read Parquet: {exc}") from None


def read_records(path: Path, batch_rows: int) -> Iterator[RawRecord]:
    """The records of ``path``: Parquet when it starts with Parquet's magic bytes, else JSONL."""
    return _parquet_records(path, batch_rows) if _is_parquet(path) else _jsonl_records(path)
