"""The built-in ``tools`` environment: the task's own tools, called by the model and executed.

A task brings its tools (``Task.tools``: name, description, JSON Schema of the arguments, in
OpenAI's function format); the chat template shows them to the model. The code behind each name is
registered as verifiers and environments are (``tasks/registry.py``):

- in the run config: ``reward: {tools: {lookup_order: "my_pkg.tools:lookup_order"}}``, read by
  every role at start (a target that does not import fails the start);
- by an installed package's entry point in the group ``conveyor.tools``;
- in code: :func:`register`.

A tool is a function of its arguments as keywords, ``fn(**arguments)``, returning text, or anything
JSON can encode (sent as JSON). It runs in the rollout worker's process (trusted code, like the
image it is installed in), under ``data.tool_timeout_s`` (10 s).

An episode (``verifier: {kind: environment, data: {environment: tools, answer: {kind, data}}}``,
``max_turns`` > 1): each model turn that makes calls has them validated and executed, and the
results come back as the next tool turn; the first turn without a call is the episode's answer,
scored by the ``answer`` verifier (any registered kind but ``environment``: ``math``, a judge, a
reward model, a user's function; sandbox kinds run in the reward service's sandbox). A call is
found as Hermes' / Qwen's ``<tool_call>{...}</tool_call>`` (several per turn), Mistral's
``[TOOL_CALLS][...]``, or a JSON object ``{"name": ..., "arguments": {...}}`` (``parameters``, as
Llama writes it, too) as the turn's last one. A call of an unknown tool, with arguments that break
its schema, that raises or that runs past its limit is answered ``error: <why>`` and the episode
goes on: the model may correct itself.

The reward follows from the answer alone, so the reward service replays only the last action
(``scores_last_action``): no tool runs twice for one sample.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from conveyor.contracts import Task
from tasks import registry
from tasks.environments import Step
from tasks.function_tools import Tool, parse_call, schema_error, tool_of
from tasks.registry import RegistryError, import_target
from tasks.time_limit import Hung, within

ENTRY_POINT_GROUP = "conveyor.tools"
DEFAULT_TIMEOUT_S = 10.0
MAX_CALLS_PER_TURN = 8
MAX_RESULT_CHARS = 4000

_impls: dict[str, Callable[..., Any] | str] = {}
_entry_points_read = False


def register(name: str, fn: Callable[..., Any] | str) -> None:
    """Bind tool ``name`` to ``fn`` (or ``"module:function"``, imported now)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name or ""):
        raise RegistryError(f"tool name {name!r}: letters, digits, '_', '.' or '-' (at most 64)")
    _impls[name] = import_target(fn, f"tool {name!r}") if isinstance(fn, str) else fn


def configure(tools: Mapping[str, str]) -> None:
    """The run config's ``reward.tools``."""
    for name, target in tools.items():
        register(name, target)


def unregister(name: str) -> None:
    _impls.pop(name, None)


def known() -> tuple[str, ...]:
    global _entry_points_read
    if not _entry_points_read:
        _entry_points_read = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _impls.setdefault(ep.name, ep.value)
    return tuple(_impls)


def implementation(name: str) -> Callable[..., Any]:
    if name not in known():
        raise RegistryError(f"tool {name!r} has no implementation; registered: {', '.join(known()) or 'none'}")
    fn = _impls[name]
    if isinstance(fn, str):  # an entry point, imported when first used
        fn = _impls[name] = import_target(fn, f"tool {name!r}")
    return fn


_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_MISTRAL = "[TOOL_CALLS]"


def _as_call(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        return {"error": "a tool call is a JSON object"}
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI's wire format: the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            pass  # left a string: the schema check names it
    return {"name": obj.get("name"), "arguments": args}


def parse_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls of a model's turn (``{"name", "arguments"}``, or ``{"error"}`` for a call that
    cannot be read); None when the turn makes none (it is the answer)."""
    tagged = _TAGGED.findall(text)
    if tagged:
        calls = []
        for body in tagged:
            try:
                calls.append(_as_call(json.loads(body)))
            except ValueError:
                calls.append({"error": f"not JSON: {body.strip()[:80]!r}"})
        return calls
    if _MISTRAL in text:
        body = text.split(_MISTRAL, 1)[1].strip()
        try:
            objs = json.JSONDecoder().raw_decode(body)[0]
        except ValueError:
            return [{"error": f"not JSON after {_MISTRAL}: {body[:80]!r}"}]
        return [_as_call(o) for o in (objs if isinstance(objs, list) else [objs])]
    found = parse_call(text)
    return None if found is None else [_as_call(found)]


def _answer_problem(spec: Any) -> str | None:
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str) or not isinstance(spec.get("data", {}), dict):
        return "data.answer: give the verifier of the answer as {kind, data}"
    if spec["kind"] == "environment":
        return "data.answer: an environment cannot score an answer"
    if spec["kind"] not in registry.known():
        return f"data.answer.kind: unknown verifier kind {spec['kind']!r}; known: {', '.join(registry.known())}"
    missing = [k for k in registry.get(spec["kind"]).required if k not in spec.get("data", {})]
    return f"data.answer.data: {spec['kind']} needs {', '.join(missing)}" if missing else None


def _number(data: Mapping[str, Any], key: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"data.{key}: a positive number, got {value!r}")
    return float(value)


class ToolsEnvironment:
    scores_last_action = True

    @staticmethod
    def check_task(data: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> str | None:
        """Why a task cannot run here (checked where tasks come in), naming what is wrong."""
        if not tools:
            return "the tools environment runs the task's tools, and the task has none"
        missing = [t.name for t in map(tool_of, tools) if t.name not in known()]
        if missing:
            return f"tools {', '.join(missing)} have no implementation here; registered: {', '.join(known()) or 'none (reward.tools registers them)'}"
        try:
            _number(data, "tool_timeout_s", DEFAULT_TIMEOUT_S)
        except ValueError as exc:
            return str(exc)
        return _answer_problem(data.get("answer"))

    def reset(self, task: Task) -> None:
        why = self.check_task(task.verifier.data, task.tools)
        if why is not None:
            raise ValueError(why)
        self.tools: dict[str, Tool] = {t.name: t for t in map(tool_of, task.tools or [])}
        self.timeout_s = _number(task.verifier.data, "tool_timeout_s", DEFAULT_TIMEOUT_S)

    def step(self, action: str) -> Step:
        calls = parse_calls(action)
        if calls is None:
            return Step("", done=True, answer=action)
        results, made = [], []
        for call in calls[:MAX_CALLS_PER_TURN]:
            result, ok = self._run(call)
            if isinstance(call.get("name"), str):  # a call that could not be read has nothing to record
                args = call["arguments"]
                made.append({"name": call["name"], "arguments": args if isinstance(args, dict) else {"raw": args}, "ok": ok})
            results.append(result)
        if len(calls) > MAX_CALLS_PER_TURN:
            results.append(f"error: {len(calls) - MAX_CALLS_PER_TURN} calls beyond {MAX_CALLS_PER_TURN} in one turn were not run")
        observation = results[0] if len(results) == 1 else "\n".join(f"[{i}] {r}" for i, r in enumerate(results, 1))
        return Step(observation, info={"tool_calls": made})

    def _run(self, call: dict[str, Any]) -> tuple[str, bool]:
        """The call's result as the model reads it, and whether the tool ran and returned."""
        if "error" in call:
            return f"error: {call['error']}", False
        name, args = call["name"], call["arguments"]
        if name not in self.tools:
            return f"error: unknown tool {name!r}; the tools are {', '.join(self.tools)}", False
        if not isinstance(args, dict):
            return f"error: the arguments of {name} must be a JSON object", False
        why = schema_error(name, args, self.tools)
        if why is not None:
            return f"error: the arguments of {name} do not match its schema at {why}", False
        fn = implementation(name)
        try:
            out = within(lambda: fn(**args), self.timeout_s, f"tool-{name}")
        except Hung as exc:
            return f"error: {name} {exc}", False
        except Exception as exc:  # noqa: BLE001 - a tool fails in any way; the model reads why
            return f"error: {name} raised {type(exc).__name__}: {exc}"[:500], False
        if not isinstance(out, str):
            try:
                out = json.dumps(out, ensure_ascii=False, default=str)
            except ValueError as exc:  # e.g. a circular structure
                return f"error: {name} returned what JSON cannot encode ({exc})", False
        if len(out) > MAX_RESULT_CHARS:
            out = out[:MAX_RESULT_CHARS] + f"... [{len(out) - MAX_RESULT_CHARS} more characters]"
        return out, True
