"""Loading a file: records in, tasks out, rejected records reported by place and field."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from conveyor.contracts import Task
from conveyor.topics import validate_run_id
from producers.loaders.errors import FieldError, RecordError, RecordRejected, TaskFileError
from producers.loaders.formats import read_records
from producers.loaders.images import PutImage
from producers.loaders.mapping import FieldMapping, resolve_mapping
from producers.loaders.records import MISSING, build_task, get_field

OnError = Literal["skip", "fail"]


class TaskLoader:
    """Streams the tasks of one file; rejected records collect in ``errors``.

    Iterate it once. ``records`` counts the records read, ``tasks`` the tasks
    yielded so far.
    """

    def __init__(
        self,
        path: str | Path,
        run_id: str,
        mapping: FieldMapping | str | dict[str, Any] | None = None,
        on_error: OnError = "fail",
        *,
        group_size: int | None = None,
        max_task_bytes: int | None = None,
        batch_rows: int = 1024,
        put_image: PutImage | None = None,
    ) -> None:
        if on_error not in ("skip", "fail"):
            raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
        if group_size is not None and group_size < 1:
            raise ValueError("group_size must be >= 1")
        self.path = Path(path)
        self.run_id = validate_run_id(run_id)
        self.mapping = resolve_mapping(mapping)
        self.on_error = on_error
        self.group_size = group_size
        self.max_task_bytes = max_task_bytes
        self.batch_rows = batch_rows
        self.put_image = put_image
        self.errors: list[RecordError] = []
        self.records = 0
        self.tasks = 0
        self._started = False
        if not self.path.is_file():
            raise TaskFileError(f"{self.path}: no such file")

    def _reject(self, error: RecordError) -> None:
        if self.on_error == "fail":
            raise RecordRejected(error)
        self.errors.append(error)

    def __iter__(self) -> Iterator[Task]:
        if self._started:
            raise RuntimeError("a TaskLoader is iterated once; make a new one to read the file again")
        self._started = True
        return self._tasks()

    def _tasks(self) -> Iterator[Task]:
        file = str(self.path)
        raws = read_records(self.path, self.batch_rows)
        seen: dict[str, str] = {}  # task id -> where it was first seen
        for raw in raws:
            self.records += 1
            where = f"{self.path.name}:{raw.line}" if raw.line is not None else f"{self.path.name}:row {raw.row}"
            if raw.error is not None:
                self._reject(RecordError(file, raw.line, raw.row, None, raw.error))
                continue
            try:
                task = build_task(
                    raw.record,
                    self.run_id,
                    self.mapping,
                    source=where,
                    group_size=self.group_size,
                    max_task_bytes=self.max_task_bytes,
                    put_image=self.put_image,
                    base_dir=self.path.parent,
                )
            except FieldError as exc:
                self._reject(RecordError(file, raw.line, raw.row, exc.field, exc.reason))
                continue
            first = seen.get(task.task_id)
            if first is not None:
                hashed = self.mapping.task_id is None or get_field(raw.record, self.mapping.task_id) is MISSING
                self._reject(
                    RecordError(
                        file,
                        raw.line,
                        raw.row,
                        "<record>" if hashed else self.mapping.task_id,
                        f"duplicate task id {task.task_id!r} (first at {first})",
                    )
                )
                continue
            seen[task.task_id] = where
            self.tasks += 1
            yield task


def iter_tasks(
    path: str | Path,
    run_id: str,
    mapping_or_preset: FieldMapping | str | dict[str, Any] | None = None,
    on_error: OnError = "fail",
    **kwargs: Any,
) -> TaskLoader:
    """The streaming form of :func:`load_tasks`: iterate the returned loader."""
    return TaskLoader(path, run_id, mapping_or_preset, on_error, **kwargs)


@dataclass
class LoadResult:
    tasks: list[Task]
    errors: list[RecordError] = field(default_factory=list)
    records: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


def load_tasks(
    path: str | Path,
    run_id: str,
    mapping_or_preset: FieldMapping | str | dict[str, Any] | None = None,
    on_error: OnError = "fail",
    **kwargs: Any,
) -> LoadResult:
    """Every task of a JSONL or Parquet file, and the records rejected.

    ``mapping_or_preset``: a :class:`FieldMapping`, a preset name (``plain``,
    ``verl``, ``trl``) or a dict of mapping fields (None: ``plain``). Keyword
    arguments: ``group_size`` (overrides every task's), ``max_task_bytes``.
    Raises :class:`RecordRejected` on the first bad record with ``on_error="fail"``,
    :class:`TaskFileError` when the file cannot be read at all.
    """
    loader = TaskLoader(path, run_id, mapping_or_preset, on_error, **kwargs)
    tasks = list(loader)
    return LoadResult(tasks, loader.errors, loader.records)
