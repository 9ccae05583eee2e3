"""One source record as a :class:`Task`, or the field at fault.

Every value is checked where it is read: the prompt or chat messages, the
verifier kind and the payload keys it cannot do without, the integers, the
split. A record that passes becomes a task that must also survive the wire
(encode and decode), under an optional size limit.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import msgspec

from conveyor.contracts import ChatMessage, DecodeError, SamplingParams, Task, VerifierSpec, decode, encode
from producers.loaders.errors import FieldError
from producers.loaders.images import PutImage, RecordImages, content_parts, lead_with_images, record_images
from producers.loaders.mapping import FieldMapping, VerifierRule
from tasks import environments, registry
from tasks.function_tools import tools_problem

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


MISSING = object()


def get_field(record: dict[str, Any], path: str) -> Any:
    """The value at a dotted path; ``MISSING`` when absent or null."""
    if path in record:
        value = record[path]
        return MISSING if value is None else value
    node: Any = record
    walked: list[str] = []
    for part in path.split("."):
        if not isinstance(node, dict):
            raise FieldError(".".join(walked), f"expected an object, got {_type_name(node)}")
        node = node.get(part, MISSING)
        if node is None or node is MISSING:
            return MISSING
        walked.append(part)
    return node


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "text", bool: "boolean", int: "integer", float: "number"}.get(
        type(value), type(value).__name__
    )


def _require(record: dict[str, Any], path: str) -> Any:
    value = get_field(record, path)
    if value is MISSING:
        raise FieldError(path, "missing")
    return value


def _as_int(value: Any, path: str, minimum: int | None = None) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(path, f"expected an integer, got {_type_name(value)}")
    if minimum is not None and value < minimum:
        raise FieldError(path, f"must be at least {minimum}, got {value}")
    return value


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _messages(value: Any, path: str, images: RecordImages) -> list[ChatMessage]:
    if not isinstance(value, list):
        raise FieldError(path, f"expected a list of chat messages, got {_type_name(value)}")
    if not value:
        raise FieldError(path, "empty list of chat messages")
    out = []
    for i, m in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(m, dict):
            raise FieldError(where, f"expected a message object {{role, content}}, got {_type_name(m)}")
        role, content, name = m.get("role"), m.get("content"), m.get("name")
        if role not in _ROLES:
            raise FieldError(f"{where}.role", f"expected one of {', '.join(_ROLES)}, got {role!r}")
        if not isinstance(content, (str, list)):
            raise FieldError(f"{where}.content", f"expected text or a list of parts, got {_type_name(content)}")
        if name is not None and not isinstance(name, str):
            raise FieldError(f"{where}.name", f"expected text, got {_type_name(name)}")
        out.append(ChatMessage(role=role, content=content_parts(content, images, f"{where}.content"), name=name))
    if not any(m.text.strip() or m.images for m in out):
        raise FieldError(path, "every chat message is empty")
    return _place_images(out, images, path)


def _place_images(messages: list[ChatMessage], images: RecordImages, path: str) -> list[ChatMessage]:
    """Images no marker placed go ahead of the first user message's content."""
    if images.used or not images.values:
        images.check_all_used()
        return messages
    at = next((i for i, m in enumerate(messages) if m.role == "user"), None)
    if at is None:
        raise FieldError(images.field, f"images but no user message in {path} to put them in")
    m = messages[at]
    placed = ChatMessage(role=m.role, content=lead_with_images(m.content, images, images.field), name=m.name)
    return [*messages[:at], placed, *messages[at + 1 :]]


def _prompt(record: dict[str, Any], mapping: FieldMapping, images: RecordImages) -> tuple[str | None, list[ChatMessage] | None]:
    """(prompt, messages): exactly one is set. A text prompt with images becomes one user message."""
    found = [
        (path, value)
        for path in (mapping.messages, mapping.prompt)
        if path is not None and (value := get_field(record, path)) is not MISSING
    ]
    if not found:
        names = " or ".join(p for p in (mapping.prompt, mapping.messages) if p)
        raise FieldError(names, "missing (no prompt)")
    if len(found) > 1:
        raise FieldError(f"{found[0][0]}|{found[1][0]}", "both are set; give the prompt once")
    path, value = found[0]
    if isinstance(value, str):
        if not value.strip():
            raise FieldError(path, "empty prompt")
        if images.values:
            return None, _messages([{"role": "user", "content": value}], path, images)
        return value, None
    if isinstance(value, list):
        return None, _messages(value, path, images)
    raise FieldError(path, f"expected text or a list of chat messages, got {_type_name(value)}")


def _check_payload(kind: str, data: dict[str, Any], sources: dict[str, str]) -> None:
    """Types of the payload keys each verifier cannot do without."""
    for key in registry.get(kind).required:
        where = sources.get(key, f"verifier.data.{key}")
        value = data.get(key)
        if value is None:
            raise FieldError(where, f"missing ({kind} verifier needs {key})")
        if key == "answer":
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise FieldError(where, f"expected text or a number, got {_type_name(value)}")
            if isinstance(value, float) and not math.isfinite(value):
                raise FieldError(where, f"not a finite number: {value}")
            if isinstance(value, str) and not value.strip():
                raise FieldError(where, "empty ground truth")
        elif key in ("tests", "checks"):
            if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
                data[key] = value = "\n".join(value)  # a list of assert statements
            if not isinstance(value, str):
                raise FieldError(where, f"expected test source (text or a list of text), got {_type_name(value)}")
            if not value.strip():
                raise FieldError(where, "empty tests")
        elif key == "expected" and not isinstance(value, dict):
            raise FieldError(where, f"expected an object, got {_type_name(value)}")
        elif key == "environment" and (why := environments.problem(value)) is not None:
            raise FieldError(where, why)


def _verifier(record: dict[str, Any], rules: list[VerifierRule]) -> VerifierSpec:
    rule = next((r for r in rules if all(get_field(record, f) is not MISSING for f in r.required_fields)), None)
    if rule is None:
        if len(rules) == 1:
            _require(record, next(f for f in rules[0].required_fields if get_field(record, f) is MISSING))
        wanted = "; ".join(f"{r.label} needs {' and '.join(r.required_fields)}" for r in rules)
        fields = "|".join(dict.fromkeys(f for r in rules for f in r.required_fields))
        raise FieldError(fields, f"missing: no verifier layout matches ({wanted})")
    if rule.kind is not None:
        kind = rule.kind
    else:
        kind = _require(record, rule.kind_field)  # type: ignore[arg-type]
        if not isinstance(kind, str):
            raise FieldError(rule.kind_field, f"expected a verifier kind (text), got {_type_name(kind)}")
        if kind not in registry.known():
            raise FieldError(rule.kind_field, f"unknown verifier kind {kind!r}; known: {', '.join(registry.known())}")
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if rule.data_field is not None:
        payload = get_field(record, rule.data_field)
        if payload is not MISSING:
            if not isinstance(payload, dict):
                raise FieldError(rule.data_field, f"expected an object, got {_type_name(payload)}")
            data.update(payload)
            sources.update({k: f"{rule.data_field}.{k}" for k in payload})
    for key, path in rule.data.items():
        data[key] = _require(record, path)
        sources[key] = path
    for key, path in rule.optional_data.items():
        if (value := get_field(record, path)) is not MISSING:
            data[key], sources[key] = value, path
    for key, value in rule.constants.items():
        data.setdefault(key, value)
    _check_payload(kind, data, sources)
    return VerifierSpec(kind=kind, data=data)


def _split(record: dict[str, Any], mapping: FieldMapping) -> str:
    if mapping.split is None or (value := get_field(record, mapping.split)) is MISSING:
        return mapping.default_split
    if not isinstance(value, str) or value.strip().lower() not in _SPLITS:
        raise FieldError(mapping.split, f"unknown split {value!r} (train or heldout; test/validation/eval mean heldout)")
    return _SPLITS[value.strip().lower()]


def _metadata(record: dict[str, Any], mapping: FieldMapping, source: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if mapping.metadata_from is not None and (extra := get_field(record, mapping.metadata_from)) is not MISSING:
        if not isinstance(extra, dict):
            raise FieldError(mapping.metadata_from, f"expected an object, got {_type_name(extra)}")
        out.update({str(k): _as_text(v) for k, v in extra.items() if v is not None})
    for path in mapping.metadata:
        if (value := get_field(record, path)) is not MISSING:
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
    put_image: PutImage | None = None,
    base_dir: Path | None = None,
) -> Task:
    """One record as a :class:`Task`; raises ``FieldError`` naming the field at fault.

    ``put_image`` keeps the record's images (``conveyor.images.store_image`` bound to a store);
    ``base_dir`` is where relative image paths start (the dataset file's folder)."""
    if not isinstance(record, dict):
        raise FieldError(None, f"expected an object, got {_type_name(record)}")
    found = MISSING if mapping.images is None else get_field(record, mapping.images)
    values = [] if found is MISSING else found
    images = record_images(values, mapping.images or "images", put_image, base_dir)
    prompt, messages = _prompt(record, mapping, images)
    verifier = _verifier(record, mapping.verifier)
    if mapping.task_id is not None and (raw_id := get_field(record, mapping.task_id)) is not MISSING:
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
            raise FieldError(mapping.task_id, f"expected text or an integer, got {_type_name(raw_id)}")
        task_id = str(raw_id).strip()
        if not task_id:
            raise FieldError(mapping.task_id, "empty task id")
    else:
        task_id = mapping.id_prefix + record_hash(record)
    size = mapping.default_group_size
    if mapping.group_size is not None and (value := get_field(record, mapping.group_size)) is not MISSING:
        size = _as_int(value, mapping.group_size, minimum=1)
    priority = 0
    if mapping.priority is not None and (value := get_field(record, mapping.priority)) is not MISSING:
        priority = _as_int(value, mapping.priority)
    sampling = None
    if mapping.sampling is not None and (value := get_field(record, mapping.sampling)) is not MISSING:
        try:
            sampling = msgspec.convert(value, SamplingParams)
        except msgspec.ValidationError as exc:
            raise FieldError(mapping.sampling, str(exc)) from None
    tools = None
    if mapping.tools is not None and (value := get_field(record, mapping.tools)) not in (MISSING, None):
        if isinstance(value, str):  # datasets often keep the tools as a JSON string
            try:
                value = json.loads(value)
            except ValueError:
                raise FieldError(mapping.tools, "not JSON (expected a list of tools)") from None
        if (why := tools_problem(value)) is not None:
            raise FieldError(mapping.tools, why)
        tools = value
    if verifier.kind == "environment" and (why := environments.task_problem(verifier.data, tools)) is not None:
        raise FieldError(mapping.tools or "tools", why)
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
        tools=tools,
    )
    # The wire is the judge: a task must survive encode/decode as a Task.
    try:
        raw = encode(task)
        decode(raw, Task)
    except (DecodeError, TypeError, ValueError) as exc:
        raise FieldError(None, f"not a valid task: {exc}") from None
    if max_task_bytes is not None and len(raw) > max_task_bytes:
        raise FieldError(None, f"encoded task is {len(raw)} bytes, over the limit of {max_task_bytes}")
    return task
