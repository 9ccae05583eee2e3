"""Environments for multi-turn agents: the model acts, the environment answers, over turns.

An environment is a class (or any factory) registered by name, as verifiers are
(``tasks/registry.py``): in the run config (``reward: {environments: {guess: "my_pkg.envs:Guess"}}``,
read by every role at start), by an installed package's entry point in the group
``conveyor.environments``, or in code with :func:`register`. Its instances follow the protocol:

``reset(task) -> str | None``
    Start an episode for ``task`` (its ``verifier.data`` carries the environment's settings). What
    it returns is shown to the model as a first observation only if the task's prompt does not
    already describe the start; return None to add nothing.
``step(action) -> Step``
    ``action`` is the model's turn as text. ``Step(observation, reward, done, info)``: the
    observation is the model's next tool turn (framed by its chat template); ``done`` ends the
    episode; ``reward`` is the episode's reward so far (the last one given counts); ``failed``
    (machine environments) rolls the workspace back to where the step began; ``answer`` (with
    ``done``) is the episode's answer, scored by the verifier the task names in ``data.answer``
    (``{kind, data}``, any registered kind but ``environment``) instead of a reward of the
    environment's own: the built-in ``tools`` environment (``tasks/tool_env.py``) ends this way.
``close()``
    Optional: release what ``reset`` took.
``check_task(data, tools) -> str | None``
    Optional (a static method): why a task cannot run (None: it can), asked where tasks come in, so
    a task the environment would refuse is refused at submission, naming what is wrong.

An environment whose reward follows from the episode's last action alone sets
``scores_last_action = True``: the reward service then replays only that action.

An environment that needs a computer sets the class attribute ``machine = True``: its ``reset`` is
then called as ``reset(task, machine)`` with the episode's :class:`tasks.machine.Machine`, a
workspace in the bubblewrap sandbox built from the task's ``data.image`` / ``data.files`` that
persists across the episode's steps (``machine.run(command)``). The workspace is snapshotted
before each step and restored when the step returns ``Step(..., failed=True)`` or raises: a step
that went wrong changes nothing. Where no sandbox can run, its tasks are refused.

A task uses one with ``verifier: {kind: environment, data: {environment: NAME, ...}}`` and
``max_turns`` > 1. The rollout worker drives the episode (its process runs the environment, trusted
code); the reward service scores it by *replaying* the episode's actions in a fresh instance and
taking the last reward, so the reward is computed where every other reward is, and an episode
stored in the lake can be scored again. An environment must therefore be deterministic given the
task and the actions (seed any randomness from the task). An environment that raises, or gives a
reward that is not a finite number, scores the sample ``error`` with the reason.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

from conveyor.contracts import Feedback, Task, VerifierSpec
from tasks import registry
from tasks.registry import RegistryError, import_target
from tasks.verdict import Verdict

ENTRY_POINT_GROUP = "conveyor.environments"


@dataclass(frozen=True)
class Step:
    observation: str
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    failed: bool = False  # a machine environment's workspace goes back to where the step began
    answer: str | None = None  # the episode's answer, scored by the task's data.answer verifier


class Environment(Protocol):
    def reset(self, task: Task) -> str | None: ...
    def step(self, action: str) -> Step: ...


class NeedsMachine(RuntimeError):
    """A machine environment where no sandbox runs."""


class Episode:
    """One episode of an environment: made, reset and stepped the same way in the rollout worker
    (which drives it) and in the reward service (which replays it), so both see the same states."""

    def __init__(self, task: Task, sandbox=None) -> None:
        name = task.verifier.data.get("environment")
        if not isinstance(name, str):
            raise RegistryError(f"task {task.task_id}: environment verifier needs data.environment")
        self.name = name
        self.env = make(name)
        self.machine = None
        try:
            if getattr(self.env, "machine", False):
                if sandbox is None:
                    raise NeedsMachine(f"environment {name!r} needs a machine and no sandbox runs here")
                from tasks.machine import Machine

                self.machine = Machine(sandbox, task)
                self.env.reset(task, self.machine)  # type: ignore[call-arg]
            else:
                self.env.reset(task)
        except BaseException:
            self.close()
            raise

    def step(self, action: str) -> Step:
        snap = self.machine.snapshot() if self.machine is not None else None
        try:
            step = self.env.step(action)
        except BaseException:
            if snap is not None:
                self.machine.restore(snap)  # type: ignore[union-attr]
            raise
        if snap is not None and step.failed:
            self.machine.restore(snap)  # type: ignore[union-attr]
        return step

    def close(self) -> None:
        try:
            close(self.env)
        finally:
            if self.machine is not None:
                self.machine.close()


# Built in, registered as users' are (imported when first used): tasks/cad.py.
_factories: dict[str, Callable[[], Environment] | str] = {
    "cad": "tasks.cad:CadEnvironment",
    "tools": "tasks.tool_env:ToolsEnvironment",
}
_entry_points_read = False


def _import(target: str, name: str) -> Callable[[], Environment]:
    return import_target(target, f"environment {name!r}")


def register(name: str, factory: Callable[[], Environment] | str) -> None:
    """Bind ``name`` to a class or factory (or ``"module:Class"``, imported now: a registration
    that cannot work fails at start)."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise RegistryError(f"environment name {name!r}: letters, digits, '_' and '-' only")
    _factories[name] = _import(factory, name) if isinstance(factory, str) else factory


def configure(environments: Mapping[str, str]) -> None:
    """The run config's ``reward.environments``."""
    for name, target in environments.items():
        register(name, target)


def unregister(name: str) -> None:
    _factories.pop(name, None)


def known() -> tuple[str, ...]:
    global _entry_points_read
    if not _entry_points_read:
        _entry_points_read = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _factories.setdefault(ep.name, ep.value)
    return tuple(_factories)


def problem(name: object) -> str | None:
    """Why a task naming ``name`` as its environment cannot be run (None: it can): what the producer's
    intake says, so a typo is refused at submission, not after a rollout was sampled."""
    if not isinstance(name, str) or not name:
        return f"expected an environment's name, got {name!r}"
    if name not in known():
        return f"unknown environment {name!r}; known: {', '.join(known()) or 'none (reward.environments registers them)'}"
    return None


def task_problem(data: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> str | None:
    """Why a task of an environment cannot run (None: it can): the name's check, then the
    environment's own ``check_task``, if it has one."""
    name = data.get("environment")
    why = problem(name)
    if why is not None:
        return f"data.environment: {why}"
    check = getattr(_factory(name), "check_task", None)  # type: ignore[arg-type]
    return check(data, tools) if callable(check) else None


def _factory(name: str) -> Callable[[], Environment]:
    if name not in known():
        raise RegistryError(f"unknown environment {name!r}; known: {', '.join(known()) or 'none registered'}")
    factory = _factories[name]
    if isinstance(factory, str):  # an entry point, imported when first used
        factory = _factories[name] = _import(factory, name)
    return factory


def make(name: str) -> Environment:
    return _factory(name)()


def needs_machine(task: Task) -> bool:
    """Whether ``task``'s environment is a machine environment (its class says ``machine = True``);
    False for anything else, an unknown name included (its replay says why it cannot run)."""
    name = task.verifier.data.get("environment") if task.verifier.kind == "environment" else None
    try:
        return isinstance(name, str) and bool(getattr(_factory(name), "machine", False))
    except RegistryError:
        return False


def needs_sandbox(task: Task) -> bool:
    """Whether scoring ``task``'s episode needs the reward service's sandbox: a machine
    environment's, or one whose answer's verifier runs there (``data.answer.kind``)."""
    if task.verifier.kind != "environment":
        return False
    inner = _inner_task(task)
    return needs_machine(task) or (inner is not None and registry.where(inner.verifier.kind) == "sandbox")


def close(env: Environment) -> None:
    closer = getattr(env, "close", None)
    if callable(closer):
        closer()


def actions_of(judged: str) -> list[str]:
    """The episode's actions as the bridge hands them over (a JSON list of the model's turns)."""
    try:
        actions = json.loads(judged)
    except ValueError:
        return [judged]
    return actions if isinstance(actions, list) and all(isinstance(a, str) for a in actions) else [judged]


def replay(task: Task, actions: list[str], sandbox=None, score_answer: Callable[[Task, str], Verdict] | None = None) -> Verdict:
    """The episode's verdict: its actions stepped through a fresh instance, the last reward given,
    or its answer's verdict by ``score_answer`` (the reward service's scorer, given the task with
    its ``data.answer`` verifier). ``sandbox``: where a machine environment's fresh machine runs
    (None: such a task is an error)."""
    name = task.verifier.data.get("environment")
    episode = None
    reward: float | None = None
    answer: str | None = None
    steps = float(len(actions))
    try:
        episode = Episode(task, sandbox)
        if getattr(episode.env, "scores_last_action", False):
            actions = actions[-1:]
        for action in actions:
            step = episode.step(action)
            if step.reward is not None:
                reward = step.reward
            if step.done:
                answer = step.answer
                break
    except RegistryError as exc:
        return Verdict(0.0, "error", Feedback(message=f"bad task: {exc}"))
    except Exception as exc:  # noqa: BLE001 - a user's environment fails in any way; the service carries on
        return Verdict(0.0, "error", Feedback(message=f"environment {name}: raised {type(exc).__name__}: {exc}"[:500]))
    finally:
        if episode is not None:
            try:
                episode.close()
            except Exception:  # noqa: BLE001 - the verdict stands; the environment leaked at worst
                pass
    if answer is not None:
        inner = _inner_task(task)
        if inner is None or score_answer is None:
            why = "data.answer names no verifier" if inner is None else "nothing here scores answers"
            return Verdict(0.0, "error", Feedback(message=f"bad task: the episode ended in an answer and {why}"))
        verdict = score_answer(inner, answer)
        return Verdict(verdict.reward, verdict.verdict, verdict.feedback, {**verdict.details, "env_steps": steps})
    if reward is None:
        return Verdict(0.0, "fail", Feedback(message=f"environment {name} gave no reward"))
    if not isinstance(reward, int | float) or not math.isfinite(reward):
        return Verdict(0.0, "error", Feedback(message=f"environment {name}: reward {reward!r} is not a finite number"))
    return Verdict(float(reward), "pass" if reward >= float(task.verifier.data.get("pass_at", 1.0)) else "fail",
                   details={"env_steps": steps})  # fmt: skip


def _inner_task(task: Task) -> Task | None:
    """``task`` with the verifier its ``data.answer`` names (None: it names none)."""
    import msgspec

    spec = task.verifier.data.get("answer")
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str) or spec["kind"] == "environment":
        return None
    return msgspec.structs.replace(task, verifier=VerifierSpec(kind=spec["kind"], data=dict(spec.get("data") or {})))


class Session:
    """One episode in the rollout worker: the environment stepped with the model's turns."""

    def __init__(self, task: Task, sandbox=None) -> None:
        self.episode = Episode(task, sandbox)
        self.done = False
        self.last: Step | None = None  # the last step's, for the turn's record (its info's tool_calls)

    def step(self, action: str) -> str | None:
        """The observation for the model's next turn; None once the episode is over (done, or the
        environment failed: the reward service's replay says why)."""
        if self.done:
            return None
        try:
            step = self.last = self.episode.step(action)
        except Exception:  # noqa: BLE001 - the episode ends; its replay scores it error with the reason
            self.done = True
            return None
        self.done = step.done
        return None if step.done else step.observation

    def close(self) -> None:
        self.episode.close()
