"""Task loaders: JSONL and Parquet files in the layouts users already have.

A :class:`FieldMapping` says which source field holds what: the prompt (plain
text or chat messages), the task id, the verifier (kind and payload), the
group size, the split, the metadata to keep. Presets cover common RL data
layouts:

``plain``
    Conveyor's own task layout: ``task_id``, ``prompt`` or ``messages``,
    ``verifier: {kind, data}``, ``group_size``, ``split``, ``priority``,
    ``sampling``, ``metadata``.
``verl``
    veRL Parquet rows: ``prompt`` (chat messages), ``reward_model:
    {ground_truth, style}``, ``data_source``, ``extra_info`` -> a ``math``
    verifier with ``answer`` = ``reward_model.ground_truth``.
``trl``
    TRL records: ``prompt`` (text or messages) and ``solution`` -> ``math``;
    or ``prompt`` and ``tests`` / ``test`` -> ``python_tests``.

Field names are dotted paths into nested objects (``reward_model.ground_truth``).
Chat messages stay messages (``Task.messages``): the rollout worker renders them
with the model's chat template.

A malformed record (bad JSON, missing field, wrong type, empty prompt, unknown
verifier kind, duplicate task id) becomes a :class:`RecordError` naming the
file, the line (JSONL, 1-based) or row (Parquet, 0-based) and the field. With
``on_error="skip"`` it is collected and the record skipped; with ``"fail"``
:class:`RecordRejected` is raised. A bad record never becomes a task.

Usage::

    result = load_tasks("train.parquet", "run-1", "verl", on_error="skip")
    result.tasks, result.errors

    loader = iter_tasks("big.jsonl", "run-1", "trl", on_error="skip")
    for task in loader:          # streams; loader.errors fills as it goes
        ...
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from conveyor.contracts import ChatMessage, DecodeError, SamplingParams, Task, VerifierSpec, decode, encode
from conveyor.errors import ConfigError, TerminalError
from conveyor.topics import validate_run_id

OnError = Literal["skip", "fail"]

# Verifier kinds the reward service knows (tasks/verifiers.py), and the payload
# keys each one cannot do without.
KNOWN_VERIFIERS: dict[str, tuple[str, ...]] = {
    "python_program": (),
    "python_tests": ("tests",),
    "math": ("answer",),
    "terminal": ("checks",),
    "tool_call": ("expected",),
}
_ROLES = ("system", "user", "assistant", "tool")
_SPLITS = {
    "train": "train",
    "training": "train",
    "heldout": "heldout",
    "held_out": "heldout",
    "held-out": "heldout",
    "test": "heldout",
    "eval": "heldout",
    "evaluation": "heldout",
    "validation": "heldout",
    "val": "heldout",
    "dev": "heldout",
}


# --------------------------------------------------------------------------
# errors


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


class _FieldError(Exception):
    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


# --------------------------------------------------------------------------
# mapping


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VerifierRule(_Model):
    """How to build the verifier of a record.

    The kind is fixed (``kind``) or read from the record (``kind_field``). The
    payload is the object in ``data_field`` (if any), plus ``data`` (payload key
    -> source field, required), plus ``optional_data`` (copied when present),
    plus ``constants``.
    """

    kind: str | None = None
    kind_field: str | None = None
    data_field: str | None = None
    data: dict[str, str] = Field(default_factory=dict)
    optional_data: dict[str, str] = Field(default_factory=dict)
    constants: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_kind(self) -> VerifierRule:
        if (self.kind is None) == (self.kind_field is None):
            raise ValueError("give exactly one of kind (fixed) or kind_field (read from the record)")
        if self.kind is not None and self.kind not in KNOWN_VERIFIERS:
            raise ValueError(f"unknown verifier kind {self.kind!r}; known: {', '.join(KNOWN_VERIFIERS)}")
        return self

    @property
    def required_fields(self) -> list[str]:
        return ([self.kind_field] if self.kind_field else []) + list(self.data.values())

    @property
    def label(self) -> str:
        return self.kind or f"<{self.kind_field}>"


class FieldMapping(_Model):
    """Which source field holds what. Optional fields fall back to their default
    when absent or null; present but invalid, they reject the record."""

    prompt: str | None = "prompt"
    """Field with the prompt: plain text or a list of chat messages {role, content}."""
    messages: str | None = None
    """Field with chat messages, for layouts that keep them apart from ``prompt``."""
    task_id: str | None = None
    """Field with the task id; absent: a stable hash of the record."""
    verifier: list[VerifierRule] = Field(default_factory=list)
    """Tried in order: the first rule whose required fields are all present applies."""
    group_size: str | None = None
    split: str | None = None
    priority: str | None = None
    sampling: str | None = None
    """Field with sampling parameters (an object like SamplingParams)."""
    metadata: list[str] = Field(default_factory=list)
    """Fields kept as metadata (non-text values as JSON); absent ones are left out."""
    metadata_from: str | None = None
    """Field with an object merged into the metadata as is."""
    default_group_size: int = Field(1, ge=1)
    default_split: Literal["train", "heldout"] = "train"
    id_prefix: str = "t-"
    """Prefix of hashed task ids."""
    record_source: bool = True
    """Add ``metadata["source"] = "file:line"`` (or ``file:row N``)."""

    @field_validator("verifier", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _has_prompt_and_verifier(self) -> FieldMapping:
        if self.prompt is None and self.messages is None:
            raise ValueError("map prompt or messages to a source field")
        if not self.verifier:
            raise ValueError("give at least one verifier rule")
        return self


PRESETS: dict[str, FieldMapping] = {
    "plain": FieldMapping(
        prompt="prompt",
        messages="messages",
        task_id="task_id",
        verifier=[VerifierRule(kind_field="verifier.kind", data_field="verifier.data")],
        group_size="group_size",
        split="split",
        priority="priority",
        sampling="sampling",
        metadata_from="metadata",
    ),
    "verl": FieldMapping(
        prompt="prompt",
        verifier=[VerifierRule(kind="math", data={"answer": "reward_model.ground_truth"})],
        split="extra_info.split",
        metadata=["data_source", "ability", "extra_info.index", "reward_model.style"],
    ),
    "trl": FieldMapping(
        prompt="prompt",
        task_id="id",
        verifier=[
            VerifierRule(kind="math", data={"answer": "solution"}),
            VerifierRule(kind="python_tests", data={"tests": "tests"}),
            VerifierRule(kind="python_tests", data={"tests": "test"}),
        ],
    ),
}


def resolve_mapping(mapping: FieldMapping | str | dict[str, Any] | None = None, preset: str | None = None) -> FieldMapping:
    """A mapping from a preset name, a :class:`FieldMapping`, or a dict of fields.

    A dict overrides the fields of a preset (its own ``preset`` key, else
    ``preset``, else ``plain``); top-level keys replace the preset's.
    """
    if isinstance(mapping, FieldMapping):
        return mapping
    if isinstance(mapping, str):
        preset, mapping = mapping, None
    overrides = dict(mapping or {})
    name = overrides.pop("preset", None) or preset or "plain"
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    if not overrides:
        return PRESETS[name]
    base = PRESETS[name].model_dump(exclude_unset=False)
    try:
        return FieldMapping(**{**base, **overrides})
    except ValidationError as exc:
        lines = [f"invalid field mapping (preset {name}):"]
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            lines.append(f"  {loc or '<root>'}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None


def load_mapping(path: str | Path, preset: str | None = None) -> FieldMapping:
    """A mapping from a YAML file of :class:`FieldMapping` fields (may name a ``preset``)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read mapping {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"mapping {path}: the top level must be a mapping of fields")
    if data.get("preset") and preset and data["preset"] != preset:
        raise ConfigError(f"mapping {path} names preset {data['preset']!r} but {preset!r} was asked for")
    return resolve_mapping(data, preset)


# --------------------------------------------------------------------------
# reading fields

_MISSING = object()


def _get(record: dict[str, Any], path: str) -> Any:
    """The value at a dotted path; ``_MISSING`` when absent or null."""
    if path in record:
        value = record[path]
        return _MISSING if value is None else value
    node: Any = record
    walked: list[str] = []
    for part in path.split("."):
        if not isinstance(node, dict):
            raise _FieldError(".".join(walked), f"expected an object, got {_type_name(node)}")
        node = node.get(part, _MISSING)
        if node is None or node is _MISSING:
            return _MISSING
        walked.append(part)
    return node


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "text", bool: "boolean", int: "integer", float: "number"}.get(
        type(value), type(value).__name__
    )


def _require(record: dict[str, Any], path: str) -> Any:
    value = _get(record, path)
    if value is _MISSING:
        raise _FieldError(path, "missing")
    return value


def _as_int(value: Any, path: str, minimum: int | None = None) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _FieldError(path, f"expected an integer, got {_type_name(value)}")
    if minimum is not None and value < minimum:
        raise _FieldError(path, f"must be at least {minimum}, got {value}")
    return value


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _messages(value: Any, path: str) -> list[ChatMessage]:
    if not isinstance(value, list):
        raise _FieldError(path, f"expected a list of chat messages, got {_type_name(value)}")
    if not value:
        raise _FieldError(path, "empty list of chat messages")
    out = []
    for i, m in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(m, dict):
            raise _FieldError(where, f"expected a message object {{role, content}}, got {_type_name(m)}")
        role, content, name = m.get("role"), m.get("content"), m.get("name")
        if role not in _ROLES:
            raise _FieldError(f"{where}.role", f"expected one of {', '.join(_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise _FieldError(f"{where}.content", f"expected text, got {_type_name(content)}")
        if name is not None and not isinstance(name, str):
            raise _FieldError(f"{where}.name", f"expected text, got {_type_name(name)}")
        out.append(ChatMessage(role=role, content=content, name=name))
    if not any(m.content.strip() for m in out):
        raise _FieldError(path, "every chat message is empty")
    return out


def _prompt(record: dict[str, Any], mapping: FieldMapping) -> tuple[str | None, list[ChatMessage] | None]:
    """(prompt, messages): exactly one is set."""
    found = [
        (path, value)
        for path in (mapping.messages, mapping.prompt)
        if path is not None and (value := _get(record, path)) is not _MISSING
    ]
    if not found:
        names = " or ".join(p for p in (mapping.prompt, mapping.messages) if p)
        raise _FieldError(names, "missing (no prompt)")
    if len(found) > 1:
        raise _FieldError(f"{found[0][0]}|{found[1][0]}", "both are set; give the prompt once")
    path, value = found[0]
    if isinstance(value, str):
        if not value.strip():
            raise _FieldError(path, "empty prompt")
        return value, None
    if isinstance(value, list):
        return None, _messages(value, path)
    raise _FieldError(path, f"expected text or a list of chat messages, got {_type_name(value)}")


def _check_payload(kind: str, data: dict[str, Any], sources: dict[str, str]) -> None:
    """Types of the payload keys each verifier cannot do without."""
    for key in KNOWN_VERIFIERS[kind]:
        where = sources.get(key, f"verifier.data.{key}")
        value = data.get(key)
        if value is None:
            raise _FieldError(where, f"missing ({kind} verifier needs {key})")
        if key == "answer":
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise _FieldError(where, f"expected text or a number, got {_type_name(value)}")
            if isinstance(value, float) and not math.isfinite(value):
                raise _FieldError(where, f"not a finite number: {value}")
            if isinstance(value, str) and not value.strip():
                raise _FieldError(where, "empty ground truth")
        elif key in ("tests", "checks"):
            if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
                data[key] = value = "\n".join(value)  # a list of assert statements
            if not isinstance(value, str):
                raise _FieldError(where, f"expected test source (text or a list of text), got {_type_name(value)}")
            if not value.strip():
                raise _FieldError(where, "empty tests")
        elif key == "expected" and not isinstance(value, dict):
            raise _FieldError(where, f"expected an object, got {_type_name(value)}")


def _verifier(record: dict[str, Any], rules: list[VerifierRule]) -> VerifierSpec:
    rule = next((r for r in rules if all(_get(record, f) is not _MISSING for f in r.required_fields)), None)
    if rule is None:
        if len(rules) == 1:
            _require(record, next(f for f in rules[0].required_fields if _get(record, f) is _MISSING))
        wanted = "; ".join(f"{r.label} needs {' and '.join(r.required_fields)}" for r in rules)
        fields = "|".join(dict.fromkeys(f for r in rules for f in r.required_fields))
        raise _FieldError(fields, f"missing: no verifier layout matches ({wanted})")
    if rule.kind is not None:
        kind = rule.kind
    else:
        kind = _require(record, rule.kind_field)  # type: ignore[arg-type]
        if not isinstance(kind, str):
            raise _FieldError(rule.kind_field, f"expected a verifier kind (text), got {_type_name(kind)}")
        if kind not in KNOWN_VERIFIERS:
            raise _FieldError(rule.kind_field, f"unknown verifier kind {kind!r}; known: {', '.join(KNOWN_VERIFIERS)}")
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if rule.data_field is not None:
        payload = _get(record, rule.data_field)
        if payload is not _MISSING:
            if not isinstance(payload, dict):
                raise _FieldError(rule.data_field, f"expected an object, got {_type_name(payload)}")
            data.update(payload)
            sources.update({k: f"{rule.data_field}.{k}" for k in payload})
    for key, path in rule.data.items():
        data[key] = _require(record, path)
        sources[key] = path
    for key, path in rule.optional_data.items():
        if (value := _get(record, path)) is not _MISSING:
            data[key], sources[key] = value, path
    for key, value in rule.constants.items():
        data.setdefault(key, value)
    _check_payload(kind, data, sources)
    return VerifierSpec(kind=kind, data=data)


def _split(record: dict[str, Any], mapping: FieldMapping) -> str:
    if mapping.split is None or (value := _get(record, mapping.split)) is _MISSING:
        return mapping.default_split
    if not isinstance(value, str) or value.strip().lower() not in _SPLITS:
        raise _FieldError(mapping.split, f"unknown split {value!r} (train or heldout; test/validation/eval mean heldout)")
    return _SPLITS[value.strip().lower()]


def _metadata(record: dict[str, Any], mapping: FieldMapping, source: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if mapping.metadata_from is not None and (extra := _get(record, mapping.metadata_from)) is not _MISSING:
        if not isinstance(extra, dict):
            raise _FieldError(mapping.metadata_from, f"expected an object, got {_type_name(extra)}")
        out.update({str(k): _as_text(v) for k, v in extra.items() if v is not None})
    for path in mapping.metadata:
        if (value := _get(record, path)) is not _MISSING:
            out[path] = _as_text(value)
    if mapping.record_source and source:
        out.setdefault("source", source)
    return out


def record_hash(record: dict[str, Any]) -> str:
    """A stable digest of a record's content (key order does not matter)."""
    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode(), digest_size=10).hexdigest()


def build_task(
    record: Any,
    run_id: str,
    mapping: FieldMapping,
    *,
    source: str = "",
    group_size: int | None = None,
    max_task_bytes: int | None = None,
) -> Task:
    """One record as a :class:`Task`; raises ``_FieldError`` naming the field at fault."""
    if not isinstance(record, dict):
        raise _FieldError(None, f"expected an object, got {_type_name(record)}")
    prompt, messages = _prompt(record, mapping)
    verifier = _verifier(record, mapping.verifier)
    if mapping.task_id is not None and (raw_id := _get(record, mapping.task_id)) is not _MISSING:
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
            raise _FieldError(mapping.task_id, f"expected text or an integer, got {_type_name(raw_id)}")
        task_id = str(raw_id).strip()
        if not task_id:
            raise _FieldError(mapping.task_id, "empty task id")
    else:
        task_id = mapping.id_prefix + record_hash(record)
    size = mapping.default_group_size
    if mapping.group_size is not None and (value := _get(record, mapping.group_size)) is not _MISSING:
        size = _as_int(value, mapping.group_size, minimum=1)
    priority = 0
    if mapping.priority is not None and (value := _get(record, mapping.priority)) is not _MISSING:
        priority = _as_int(value, mapping.priority)
    sampling = None
    if mapping.sampling is not None and (value := _get(record, mapping.sampling)) is not _MISSING:
        try:
            sampling = msgspec.convert(value, SamplingParams)
        except msgspec.ValidationError as exc:
            raise _FieldError(mapping.sampling, str(exc)) from None
    task = Task(
        task_id=task_id,
        run_id=run_id,
        prompt=prompt,
        messages=messages,
        verifier=verifier,
        group_size=group_size or size,
        sampling=sampling,
        split=_split(record, mapping),  # type: ignore[arg-type]
        priority=priority,
        metadata=_metadata(record, mapping, source),
    )
    # The wire is the judge: a task must survive encode/decode as a Task.
    try:
        raw = encode(task)
        decode(raw, Task)
    except (DecodeError, TypeError, ValueError) as exc:
        raise _FieldError(None, f"not a valid task: {exc}") from None
    if max_task_bytes is not None and len(raw) > max_task_bytes:
        raise _FieldError(None, f"encoded task is {len(raw)} bytes, over the limit of {max_task_bytes}")
    return task


# --------------------------------------------------------------------------
# files


@dataclass(frozen=True)
class _Raw:
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


def _jsonl_records(path: Path) -> Iterator[_Raw]:
    opener = gzip.open if _is_gzip(path) else open
    with opener(path, "rb") as f:  # type: ignore[operator]
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield _Raw(n, None, error=f"not UTF-8 text: {exc.reason} at byte {exc.start}")
                continue
            if not text.strip():
                continue
            try:
                yield _Raw(n, None, record=json.loads(text))
            except json.JSONDecodeError as exc:
                yield _Raw(n, None, error=f"invalid JSON: {exc.msg} (column {exc.colno})")


def _parquet_records(path: Path, batch_rows: int) -> Iterator[_Raw]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        row = 0
        for batch in pf.iter_batches(batch_size=batch_rows):
            for record in batch.to_pylist():
                yield _Raw(None, row, record=record)
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise TaskFileError(f"{path}: cannot read Parquet: {exc}") from None


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
        raws = _parquet_records(self.path, self.batch_rows) if _is_parquet(self.path) else _jsonl_records(self.path)
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
                )
            except _FieldError as exc:
                self._reject(RecordError(file, raw.line, raw.row, exc.field, exc.reason))
                continue
            first = seen.get(task.task_id)
            if first is not None:
                hashed = self.mapping.task_id is None or _get(raw.record, self.mapping.task_id) is _MISSING
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
