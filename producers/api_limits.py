"""What the producer's HTTP API refuses, and why, before anything reaches the tasks topic.

Every refusal is a 4xx naming the field (``loc``) and the reason; none may surface as a 5xx,
because a 5xx tells the client to retry a request that can never succeed.

- :func:`parse_json` reads a body strictly: NaN/Infinity literals, non-finite floats, integers
  outside 64 bits and lone UTF-16 surrogates are refused with their path. Python's ``json``
  accepts all four, and each would fail later (response rendering, msgpack encoding) as a 500
  or a 503.
- :func:`task_errors` applies the run's limits (``ProducerConfig``) to one validated task:
  sizes and counts, ``verifier.data`` depth and encoded size, sandbox image roots.
- :class:`TokenBucket` paces requests per bearer token.

Not covered here: authentication and the body-size cap (``producers/api_guard.py``, they act
before the body is read), and whether a verifier's own payload makes sense (the verifier scores
a malformed payload as a failure).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec

from conveyor.config import ProducerConfig
from conveyor.contracts import MAX_DATA_DEPTH, nesting_depth

MAX_BODY_DEPTH = MAX_DATA_DEPTH + 8
"""Deepest nesting of a whole request body: a task's ``verifier.data`` sits five levels down."""
MAX_STOP = 16
MAX_STOP_CHARS = 1000
MAX_ERRORS = 20
"""Errors reported per request: enough to fix a batch, bounded for a hostile one."""
_INT64 = 1 << 63
_MAX_IMAGE_CHARS = 4096


def error(loc: Sequence[Any], msg: str, typ: str) -> dict:
    """One entry of a 4xx's ``detail``, in FastAPI's shape."""
    return {"loc": [safe_text(p) if isinstance(p, str) else p for p in loc], "msg": safe_text(msg), "type": typ}


def safe_text(s: str, limit: int = 300) -> str:
    """``s`` as a response may carry it: valid UTF-8 (lone surrogates escaped) and bounded, since
    error messages quote what the client sent."""
    s = s if len(s) <= limit else s[:limit] + "..."
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


class BodyRejected(Exception):
    """A request body refused before validation; ``errors`` in :func:`error`'s shape."""

    def __init__(self, status: int, errors: list[dict]) -> None:
        super().__init__(status, errors)
        self.status = status
        self.errors = errors


class _Refused:
    """A parsed value that stands for a literal refused during parsing (kept so the walk can name its path)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


_NON_FINITE = _Refused("NaN and Infinity are not JSON numbers")
_HUGE_INT = _Refused("integer out of range (at most 64 bits)")


_LONG_DIGITS = re.compile(rb"[0-9]{22}")


def _parse_int(s: str) -> int | _Refused:
    # int() of thousands of digits is slow and, past 4300, raises: refuse long literals unparsed.
    return int(s) if len(s) <= 21 else _HUGE_INT


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or :class:`BodyRejected` (422) naming each bad value's path."""
    try:
        # The int hook costs a Python call per integer: only a body with a long digit run needs it.
        long_ints = _parse_int if _LONG_DIGITS.search(raw) else None
        obj = json.loads(raw, parse_constant=lambda _s: _NON_FINITE, parse_int=long_ints)
    except RecursionError:
        raise BodyRejected(422, [error(["body"], f"nested deeper than {MAX_BODY_DEPTH} levels", "too_deep")]) from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise BodyRejected(422, [error(["body", exc.pos], f"invalid JSON: {exc.msg} ({where})", "json_invalid")]) from None
    except (ValueError, UnicodeDecodeError):
        raise BodyRejected(422, [error(["body"], "the body is not JSON text in UTF-8", "json_invalid")]) from None
    errors: list[dict] = []
    _walk({"body": obj}, [], 0, errors)
    if errors:
        raise BodyRejected(422, errors)
    return obj


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _walk(node: dict | list, loc: list, depth: int, errors: list[dict]) -> None:
    """Every value below ``node``; scalars are checked inline (a body may hold a million of them)."""
    if depth > MAX_BODY_DEPTH:
        errors.append(error(loc, f"nested deeper than {MAX_BODY_DEPTH} levels", "too_deep"))
        return
    for k, v in node.items() if isinstance(node, dict) else enumerate(node):
        if len(errors) >= MAX_ERRORS:
            return
        if type(k) is str and not (k.isascii() or _encodes(k)):
            errors.append(error([*loc, k], "a lone UTF-16 surrogate in a key is not text", "string_unicode"))
            continue
        t = type(v)
        if t is dict or t is list:
            _walk(v, [*loc, k], depth + 1, errors)
        elif t is str:
            if not (v.isascii() or _encodes(v)):
                errors.append(error([*loc, k], "a lone UTF-16 surrogate is not text", "string_unicode"))
        elif t is int:
            if not -_INT64 <= v < _INT64:
                errors.append(error([*loc, k], _HUGE_INT.reason, "number_invalid"))
        elif t is float:
            if not math.isfinite(v):
                errors.append(error([*loc, k], "number out of range (not finite)", "number_invalid"))
        elif t is _Refused:
            errors.append(error([*loc, k], v.reason, "number_invalid"))


def resolved_roots(roots: Sequence[str]) -> list[Path]:
    return [Path(os.path.realpath(r)) for r in roots]


def image_error(image: Any, roots: Sequence[Path]) -> str | None:
    """Why ``image`` may not be a task's sandbox image, or None. The path is resolved (``..`` and
    symlinks, as this host sees them) before it is compared with the roots, so neither can escape."""
    if not roots:
        return "sandbox images are not accepted here (producer.image_roots and reward.image_roots are empty)"
    if not isinstance(image, str) or not image or len(image) > _MAX_IMAGE_CHARS or "\x00" in image:
        return "must be a directory path (a string)"
    path = PurePosixPath(image)
    if not path.is_absolute():
        return "must be an absolute path"
    if ".." in path.parts:
        return "must not contain '..'"
    try:
        real = Path(os.path.realpath(image))
    except (OSError, ValueError):
        return "is not a valid path"
    if any(real.is_relative_to(root) for root in roots):
        return None
    return f"must lie inside one of producer.image_roots ({', '.join(map(str, roots))})"


def task_errors(task: Any, loc: list, pc: ProducerConfig, max_tokens: int, roots: Sequence[Path]) -> list[dict]:
    """The run's limits on one validated task (``producers.api.TaskIn``); [] when it is within them."""
    out: list[dict] = []

    def over(field: list, n: int, limit: int, what: str) -> None:
        if n > limit:
            out.append(error([*loc, *field], f"{what} {n} exceeds the limit of {limit}", "too_long"))

    if task.prompt is not None:
        over(["prompt"], len(task.prompt), pc.max_prompt_chars, "prompt length (characters)")
    if task.messages is not None:
        over(["messages"], len(task.messages), pc.max_messages, "message count")
        for i, m in enumerate(task.messages[: pc.max_messages]):
            over(["messages", i, "content"], len(m.text), pc.max_message_chars, "message length (characters)")
    if task.group_size is not None:
        over(["group_size"], task.group_size, pc.max_group_size, "group_size")
    if task.sampling is not None:
        over(["sampling", "max_tokens"], task.sampling.max_tokens, max_tokens, "max_tokens")
    over(["metadata"], len(task.metadata), pc.max_metadata_entries, "metadata entries")
    for k, v in list(task.metadata.items())[: pc.max_metadata_entries]:
        over(["metadata", k], max(len(k), len(v)), pc.max_metadata_chars, "metadata key or value length (characters)")
    data, data_loc = task.verifier.data, [*loc, "verifier", "data"]
    if nesting_depth(data) > MAX_DATA_DEPTH:
        out.append(error(data_loc, f"nested deeper than {MAX_DATA_DEPTH} levels", "too_deep"))
    else:
        size = len(msgspec.msgpack.encode(data))
        over(["verifier", "data"], size, pc.max_verifier_data_bytes, "encoded size (bytes)")
    if "image" in data and (why := image_error(data["image"], roots)) is not None:
        out.append(error([*data_loc, "image"], why, "value_error"))
    return out


class TokenBucket:
    """Per-key token buckets: each key may take ``burst`` requests at once, then ``rate_per_s``.

    ``take`` answers 0 when the request may go ahead, else the seconds until it could (the
    Retry-After). Keys are bearer tokens' positions in the configuration, so the table's size is
    bounded by the operator, not by clients."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate_per_s > 0 and burst >= 1")
        self.rate, self.burst, self._clock = rate_per_s, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when)

    def take(self, key: str) -> float:
        now = self._clock()
        tokens, then = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        if tokens >= 1:
            self._buckets[key] = (tokens - 1, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1 - tokens) / self.rate
