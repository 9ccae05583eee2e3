"""The ways a record is rejected, and the error a loader reports for it."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.errors import TerminalError


@dataclass(frozen=True)
class RecordError:
    """One rejected record: where it is, which field, and why."""

    file: str
    line: int | None  # JSONL: 1-based line number
    row: int | None  # Parquet: 0-based row index
    field: str | None  # the source field at fault; None for the record as a whole
    reason: str

    @property
    def location(self) -> str:
        if self.line is not None:
            return f"{self.file}:{self.line}"
        if self.row is not None:
            return f"{self.file}:row {self.row}"
        return self.file

    def __str__(self) -> str:
        return f"{self.location}: {self.field or '<record>'}: {self.reason}"


class RecordRejected(TerminalError):
    """A malformed record under ``on_error="fail"``; ``.error`` says where and why."""

    def __init__(self, error: RecordError) -> None:
        super().__init__(str(error))
        self.error = error


class TaskFileError(TerminalError):
    """The file as a whole cannot be read (missing, not JSONL/Parquet, corrupt)."""

    exit_code = 2


class FieldError(Exception):
    """A record's field at fault (``None``: the record as a whole); the loader reports it as a :class:`RecordError`."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason
