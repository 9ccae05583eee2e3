"""Verifier kinds: a name bound to how it scores. The built-in kinds and users' register alike.

A user's verifier is a Python function, registered

- in the run config: ``reward: {verifiers: {my_kind: "my_pkg.rewards:score"}}`` (or a mapping
  with ``fn``, ``style``, ``required``, ``pass_at``), read by every service at start;
- by an installed package's entry point in the group ``conveyor.verifiers``
  (``my_kind = "my_pkg.rewards:score"``);
- in code: :func:`register`.

Two signatures:

``style="trl"`` (the default): TRL's reward functions, ``fn(prompts, completions, **fields) ->
list[float]``: one call per batch of samples of the kind, ``prompts`` as text or chat messages,
every key of the tasks' ``verifier.data`` as a list beside them. A reward at or above
``pass_at`` (1.0) counts as a pass.

``style="verdict"``: ``fn(tasks, completions) -> list[Verdict | (reward, verdict[, feedback])]``,
for verifiers that say why (the feedback is what a self-correction turn shows the model).

Where they run: a user's function runs in the reward worker's process (it is trusted code, as
the image it is installed in); the built-in kinds that execute the model's code
(``python_program``, ``python_tests``, ``terminal``) run that code in the sandbox. A function that
raises, returns the wrong count, or a reward that is not a finite number scores those samples
``error`` with the reason, and the reward service carries on.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Literal

ENTRY_POINT_GROUP = "conveyor.verifiers"


@dataclass(frozen=True)
class VerifierKind:
    name: str
    required: tuple[str, ...] = ()
    """``verifier.data`` keys a task of this kind cannot do without (checked where tasks come in)."""
    where: Literal["sandbox", "worker"] = "worker"
    builtin: bool = False
    fn: Callable | str | None = None  # a user's function, or "module:function" imported at first use
    style: Literal["trl", "verdict"] = "trl"
    pass_at: float = 1.0

    def function(self) -> Callable:
        if isinstance(self.fn, str):
            return _import(self.fn, self.name)
        if self.fn is None:
            raise RegistryError(f"verifier {self.name!r} is built in: tasks/verifiers.py scores it")
        return self.fn


class RegistryError(ValueError):
    """A registration that cannot work (bad name, bad target, a clash with a built-in)."""


_BUILTIN = (
    VerifierKind("python_program", (), "sandbox", True),
    VerifierKind("python_tests", ("tests",), "sandbox", True),
    VerifierKind("math", ("answer",), "worker", True),
    VerifierKind("terminal", ("checks",), "sandbox", True),
    VerifierKind("tool_call", ("expected",), "worker", True),
    VerifierKind("reward_model", ("model",), "worker", True),
    VerifierKind("judge", ("rubric",), "worker", True),
    VerifierKind("environment", ("environment",), "worker", True),
)
_kinds: dict[str, VerifierKind] = {k.name: k for k in _BUILTIN}
_entry_points_read = False


def import_target(target: str, what: str) -> Callable:
    """``"module:function"`` imported; ``what`` (e.g. ``verifier 'length'``) names it in the error."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise RegistryError(f"{what}: {target!r} is not 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(f"{what}: cannot import {target!r} ({exc})") from None
    if not callable(fn):
        raise RegistryError(f"{what}: {target!r} is not callable")
    return fn


def _import(target: str, name: str) -> Callable:
    return import_target(target, f"verifier {name!r}")


def register(
    name: str,
    fn: Callable | str,
    *,
    style: Literal["trl", "verdict"] = "trl",
    required: Sequence[str] = (),
    pass_at: float = 1.0,
) -> VerifierKind:
    """Bind ``name`` to ``fn`` (a function or ``"module:function"``); a user's kind may be
    registered again (the newer binding wins), a built-in's name may not be taken."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise RegistryError(f"verifier name {name!r}: letters, digits, '_' and '-' only")
    if name in _kinds and _kinds[name].builtin:
        raise RegistryError(f"verifier {name!r} is built in; choose another name")
    if style not in ("trl", "verdict"):
        raise RegistryError(f"verifier {name!r}: style {style!r} is trl or verdict")
    # A target named by text is imported now: a registration that cannot work fails at start.
    kind = VerifierKind(
        name, tuple(required), "worker", False, _import(fn, name) if isinstance(fn, str) else fn, style, float(pass_at)
    )
    _kinds[name] = kind
    return kind


def configure(verifiers: Mapping[str, str | Mapping[str, Any]]) -> None:
    """Register the run config's ``reward.verifiers``; a bad entry raises RegistryError naming it."""
    for name, spec in verifiers.items():
        if isinstance(spec, str):
            register(name, spec)
        else:
            extra = set(spec) - {"fn", "style", "required", "pass_at"}
            if "fn" not in spec or extra:
                raise RegistryError(f"reward.verifiers.{name}: give fn (and optionally style, required, pass_at)")
            register(name, spec["fn"], style=spec.get("style", "trl"), required=spec.get("required", ()),
                     pass_at=spec.get("pass_at", 1.0))  # fmt: skip


def _read_entry_points() -> None:
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _kinds:  # imported when first used: an installed plugin costs nothing until then
            _kinds[ep.name] = VerifierKind(ep.name, fn=ep.value)


def kinds() -> dict[str, VerifierKind]:
    """Every kind registered, the built-in ones first."""
    _read_entry_points()
    return dict(_kinds)


def known() -> tuple[str, ...]:
    return tuple(kinds())


def get(name: str) -> VerifierKind:
    found = kinds().get(name)
    if found is None:
        raise RegistryError(f"unknown verifier kind {name!r}; known: {', '.join(known())}")
    return found


def where(name: str) -> str | None:
    """Where a kind's scoring runs (``sandbox`` or ``worker``); None for a kind nobody registered."""
    _read_entry_points()
    found = _kinds.get(name)  # not kinds(): this is asked once per rollout the bridge submits
    return found.where if found is not None else None


def unregister(name: str) -> None:
    """Remove a user's kind (tests)."""
    if name in _kinds and not _kinds[name].builtin:
        del _kinds[name]


def prompt_of(task) -> str | list[dict[str, str]]:
    """A task's prompt as TRL's reward functions take it: text, or chat messages."""
    if task.messages:
        return [{"role": m.role, "content": m.text} for m in task.messages]
    return task.prompt or ""


def finite(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None
