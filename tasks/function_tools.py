"""The tool environment of ``tool_call`` tasks: tools and their argument schemas.

Each tool is a name, a description and a JSON Schema (draft 2020-12) for
its arguments; ``spec()`` is the OpenAI-style function description that a
prompt shows the model. ``schema_error`` validates a call's arguments with
``jsonschema`` and names the first problem with its JSON path
(``$.unit: 'kelvin' is not one of ['celsius', 'fahrenheit']``).

Schemas are strict (``additionalProperties: false``) and describe formats
with patterns rather than ``format`` (which jsonschema does not enforce by
default): dates are ``YYYY-MM-DD``, times ``YYYY-MM-DDTHH:MM[:SS]``,
currencies and airports upper-case ISO/IATA codes.

``parse_call`` finds the call in a completion (the last JSON object with a
``"name"``, fenced blocks first) and ``values_match`` compares an argument
with the expected one: numbers within a relative tolerance, strings
ignoring case and runs of white space (ISO dates and times as instants, so
``T14:00`` equals ``T14:00:00``), lists as multisets, objects on the
expected keys.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

_CODE = {"type": "string", "pattern": "^[A-Z]{3}$"}
_DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
_DATETIME = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2})?$"}
_EMAIL = {"type": "string", "pattern": r"^[^@\s]+@[^@\s]+\.[^@\s]+$"}


def _object(required: list[str], **properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON Schema of the arguments

    def spec(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @cached_property
    def validator(self) -> Draft202012Validator:
        return Draft202012Validator(self.parameters)


TOOLS: dict[str, Tool] = {t.name: t for t in (
    Tool("get_weather", "Current weather in a city.", _object(
        ["city"],
        city={"type": "string", "minLength": 1, "description": "City name, e.g. 'Paris'"},
        unit={"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
    )),
    Tool("search_flights", "Search one-way flights.", _object(
        ["origin", "destination", "date"],
        origin=dict(_CODE, description="IATA airport code, e.g. 'LHR'"),
        destination=dict(_CODE, description="IATA airport code"),
        date=dict(_DATE, description="Departure date, YYYY-MM-DD"),
        max_price={"type": "number", "exclusiveMinimum": 0, "description": "Highest fare per passenger"},
        passengers={"type": "integer", "minimum": 1, "maximum": 9, "default": 1},
    )),
    Tool("convert_currency", "Convert an amount of money between currencies.", _object(
        ["amount", "from", "to"],
        amount={"type": "number", "exclusiveMinimum": 0},
        **{"from": dict(_CODE, description="ISO 4217 code, e.g. 'USD'"), "to": dict(_CODE, description="ISO 4217 code")},
    )),
    Tool("create_event", "Create a calendar event.", _object(
        ["title", "start", "duration_minutes"],
        title={"type": "string", "minLength": 1},
        start=dict(_DATETIME, description="Local start time, YYYY-MM-DDTHH:MM"),
        duration_minutes={"type": "integer", "minimum": 1, "maximum": 1440},
        attendees={"type": "array", "items": _EMAIL, "uniqueItems": True},
    )),
    Tool("send_email", "Send an e-mail.", _object(
        ["to", "subject", "body"],
        to={"type": "array", "items": _EMAIL, "minItems": 1, "uniqueItems": True},
        subject={"type": "string"},
        body={"type": "string"},
    )),
)}  # fmt: skip


def schema_error(name: str, arguments: Any, tools: dict[str, Tool] | None = None) -> str | None:
    """None when ``arguments`` satisfy the schema of tool ``name`` (of ``tools``, else the built-in
    ones); else the first problem, with its JSON path."""
    err = best_match((tools or TOOLS)[name].validator.iter_errors(arguments))
    return None if err is None else f"{err.json_path}: {err.message}"


def tool_of(spec: dict[str, Any]) -> Tool:
    """A task's tool, in OpenAI's format (``{"type": "function", "function": {...}}``) or flat
    (``{"name", "description", "parameters"}``)."""
    fn = spec.get("function", spec) if spec.get("type") == "function" else spec
    return Tool(fn["name"], fn.get("description", ""), fn.get("parameters") or {"type": "object", "properties": {}})


def tools_problem(specs: Any) -> str | None:
    """Why a task's ``tools`` cannot be used (naming the tool and what is wrong), or None."""
    from jsonschema.exceptions import SchemaError

    if not isinstance(specs, list) or not specs:
        return "expected a non-empty list of tools"
    names: set[str] = set()
    for i, spec in enumerate(specs):
        fn = spec.get("function", spec) if isinstance(spec, dict) and spec.get("type") == "function" else spec
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"])
        ):
            return f"tools[{i}]: needs a name of letters, digits, '_', '.' or '-' (at most 64)"
        if fn["name"] in names:
            return f"tools[{i}]: {fn['name']!r} is given twice"
        names.add(fn["name"])
        if not isinstance(fn.get("description", ""), str):
            return f"tools[{i}] ({fn['name']}): description must be text"
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            return f"tools[{i}] ({fn['name']}): parameters must be a JSON Schema object"
        try:
            Draft202012Validator.check_schema(params)
        except SchemaError as exc:
            return f"tools[{i}] ({fn['name']}): parameters is not a valid JSON Schema: {exc.message}"
    return None


def tools_of(task) -> dict[str, Tool]:
    """The tools a task's model may call: the task's own, else the built-in ones."""
    return {t.name: t for t in map(tool_of, task.tools)} if task.tools else TOOLS


_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.S)
_DECODER = json.JSONDecoder()


def _objects(text: str) -> list[dict]:
    """The top-level JSON objects embedded in ``text``, in order."""
    out, i = [], text.find("{")
    while i != -1:
        try:
            obj, end = _DECODER.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            out.append(obj)
        i = text.find("{", end)
    return out


def parse_call(text: str) -> dict | None:
    """The last ``{"name": ...}`` object of the last fenced block that has one, else of the bare text.

    ``arguments`` sent as a JSON string (OpenAI style) are decoded."""
    for chunk in [*reversed(_FENCE.findall(text)), text]:
        calls = [o for o in _objects(chunk) if "name" in o]
        if calls:
            call = calls[-1]
            if isinstance(call.get("arguments"), str):
                try:
                    call = dict(call, arguments=json.loads(call["arguments"]))
                except ValueError:
                    pass  # left a string: the verifier says it is not an object
            return call
    return None


def _norm(s: str) -> str:
    s = " ".join(s.split())
    try:
        return datetime.fromisoformat(s).isoformat()
    except ValueError:
        return s.casefold()


def values_match(got: Any, want: Any, tol: float = 1e-6) -> bool:
    if isinstance(want, bool) or want is None:
        return got is want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, want, rel_tol=tol, abs_tol=tol)
    if isinstance(want, str):
        return isinstance(got, str) and _norm(got) == _norm(want)
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return False
        rest = list(got)
        for w in want:
            j = next((j for j, g in enumerate(rest) if values_match(g, w, tol)), None)
            if j is None:
                return False
            rest.pop(j)
        return True
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and values_match(got[k], v, tol) for k, v in want.items())
    return bool(got == want)
