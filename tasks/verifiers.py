"""Verifiers: turn a completion, and what the sandbox saw, into a reward.

Each kind reads its own payload from ``task.verifier.data``:

``python_program`` (the demo's family)
    The program is ``task.prompt + completion``; it passes when it exits 0.
    ``answer_format: int_literal`` first requires the completion to be an
    integer literal (a format check: without it a policy learns to write the
    expression itself, which passes every assert).
``python_tests``
    ``tests`` (source), ``style`` (``assert``: every top-level assert is a
    test; ``functions``: every ``test*`` function is), ``reward``
    (``fraction`` of tests passed, or ``all`` or nothing), ``prepend_prompt``
    (run ``prompt + completion`` rather than the completion alone). The
    completion's code is taken from its last fenced code block when it has
    one. The solution runs first; the tests are handed to its process
    afterwards and run against its namespace.
``math``
    ``answer`` (the ground truth), ``tolerance`` (relative, for numbers;
    default 1e-6). The final answer is taken from ``\\boxed{...}``, a
    ``#### x`` line, an ``answer: x`` line, or else the last number;
    fractions, LaTeX ``\\frac``, thousands separators, ``$`` and ``%`` are
    normalised. No sandbox.
``terminal``
    ``files`` (initial workspace: path -> content) and/or ``image`` (a base
    directory on the reward worker, inside ``reward.image_roots``),
    ``checks`` (Python source, run in the workspace after the commands,
    ``style`` as above), ``reward`` as above.
    The completion is a shell script (last fenced block when it has one),
    run with ``/bin/sh -e`` in the workspace.
``tool_call``
    ``expected`` (``name``, and the ``arguments`` that must match; other
    arguments are only schema-checked), ``tolerance`` (relative, for
    numbers; default 1e-6). The completion's call is its last JSON object
    ``{"name": ..., "arguments": {...}}`` (a fenced block's first); the
    arguments are validated with ``jsonschema`` against the tool's schema
    (the task's own ``tools``, else ``tasks/function_tools.py``'s), then compared with the expected ones (strings
    ignoring case, ISO date-times as instants, lists in any order). Reward 1
    or 0; the feedback names the unknown tool, the schema error's JSON path
    or the wrong argument, never the expected value. No sandbox.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

from conveyor.contracts import Feedback, Task
from sandbox import tempdirs
from sandbox.runner import ExecResult, Job, Sandbox
from sandbox.workspace import Workspace
from tasks import registry
from tasks.environments import actions_of, replay
from tasks.function_tools import parse_call, schema_error, tools_of, values_match
from tasks.judge import judge_verdicts
from tasks.machine import workspace_base
from tasks.math_answers import judge_math
from tasks.time_limit import Hung, within
from tasks.verdict import Verdict, VerifierError

DEFAULT_FN_TIMEOUT_S = 60.0
_INT_LITERAL = re.compile(r"^ ?-?\d+\n?$")
_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.S)


def code_of(completion: str) -> str:
    """The last fenced code block, or the completion itself."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def program_of(task: Task, completion: str) -> str | None:
    """``python_program``: the program to execute, or None when the completion fails the format check."""
    fmt = task.verifier.data.get("answer_format")
    if fmt == "int_literal" and not _INT_LITERAL.match(completion):
        return None
    return (task.prompt or "") + completion


def _feedback(result: ExecResult) -> Feedback:
    fb = result.feedback or {}
    return Feedback(
        exception_type=fb.get("type"),
        message=fb.get("message") or result.stderr[-300:] or None,
        file=fb.get("file"),
        line=fb.get("line"),
        failing_test=fb.get("failing_test"),
        text=result.stderr[-1000:],
    )


def _details(result: ExecResult) -> dict[str, float]:
    d = {"duration_s": result.duration_s}
    if result.peak_memory_mb is not None:
        d["peak_memory_mb"] = result.peak_memory_mb
    if result.tests:
        d["tests_passed"], d["tests_total"] = result.tests["passed"], result.tests["total"]
    return d


def judge(task: Task, completion: str, result: ExecResult | None) -> Verdict:
    """``python_program``: ``result`` is None when ``program_of`` refused the completion."""
    if result is None:
        return Verdict(0.0, "fail", Feedback(message="the answer must be an integer literal", text=completion[:200]))
    if result.verdict == "pass":
        return Verdict(1.0, "pass", None, _details(result))
    return Verdict(0.0, result.verdict, _feedback(result), _details(result))


def _tests_reward(data: dict, result: ExecResult) -> Verdict:
    tests = result.tests
    if result.verdict == "pass":
        return Verdict(1.0, "pass", None, _details(result))
    reward = 0.0
    if tests and tests["total"] and data.get("reward", "all") == "fraction":
        reward = tests["passed"] / tests["total"]
    return Verdict(reward, result.verdict, _feedback(result), _details(result))


# --------------------------------------------------------------------------
# tool calls


def judge_tool_call(task: Task, completion: str) -> Verdict:
    data = task.verifier.data
    expected = data.get("expected")
    tools = tools_of(task)
    if not isinstance(expected, dict) or expected.get("name") not in tools or not isinstance(expected.get("arguments", {}), dict):
        raise VerifierError(f"task {task.task_id}: tool_call needs data.expected with a known tool name and an arguments object")

    def fail(message: str) -> Verdict:
        return Verdict(0.0, "fail", Feedback(message=message, text=completion[-200:]))

    call = parse_call(completion)
    if call is None:
        return fail('no tool call found: answer with a JSON object {"name": ..., "arguments": {...}}')
    name, args = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or name not in tools:
        return fail(f"unknown tool {name!r}; the tools are {', '.join(tools)}")
    if not isinstance(args, dict):
        return fail(f"the arguments of {name} must be a JSON object")
    error = schema_error(name, args, tools)
    if error is not None:
        return fail(f"the arguments of {name} do not match its schema at {error}")
    if name != expected["name"]:
        return fail(f"{name} is not the tool this request needs")
    tol = float(data.get("tolerance", 1e-6))
    for key, want in expected.get("arguments", {}).items():
        if key not in args:
            return fail(f"argument {key!r} of {name} is missing")
        if not values_match(args[key], want, tol):
            return fail(f"argument {key!r} of {name} has the wrong value {args[key]!r}")
    return Verdict(1.0, "pass")


# --------------------------------------------------------------------------
# batch scoring


def _python_tests_job(task: Task, completion: str) -> Job:
    data = task.verifier.data
    if not isinstance(data.get("tests"), str):
        raise VerifierError(f"task {task.task_id}: python_tests needs data.tests (source)")
    code = code_of(completion)
    if data.get("prepend_prompt"):
        code = (task.prompt or "") + code
    return Job(code, tests=data["tests"], test_style=data.get("style", "assert"))


def _terminal(sandbox: Sandbox, task: Task, completion: str) -> Verdict:
    data = task.verifier.data
    if not isinstance(data.get("checks"), str):
        raise VerifierError(f"task {task.task_id}: terminal needs data.checks (source)")
    with tempdirs.temporary("term") as tmp:
        base = workspace_base(task, Path(tmp), sandbox.image_roots)
        with Workspace(base, root=Path(tmp) / "ws") as ws:
            script = code_of(completion)
            commands, checks = sandbox.run(
                [
                    Job(kind="command", argv=("/bin/sh", "-e", "-c", script)),
                    Job("", tests=data["checks"], test_style=data.get("style", "functions")),
                ],
                ws,
            )
    if commands.verdict in ("timeout", "memory", "output_limit", "infra"):
        return Verdict(0.0, commands.verdict, _feedback(commands), _details(commands))
    v = _tests_reward(data, checks)
    details = dict(v.details, commands_exit_code=float(commands.exit_code or 0))
    if v.feedback is not None and commands.exit_code:
        fb = v.feedback
        v = Verdict(v.reward, v.verdict, Feedback(
            exception_type=fb.exception_type, message=fb.message, failing_test=fb.failing_test,
            text=f"commands exited {commands.exit_code}: {commands.stderr[-500:]}",
        ), details)  # fmt: skip
    return Verdict(v.reward, v.verdict, v.feedback, details)


def _reward_model_verdicts(model: str, items: Sequence[tuple[Task, str]]) -> list[Verdict]:
    """``tasks/reward_model.py``'s scores as verdicts; a model that cannot be loaded or run scores
    its samples ``error`` with the reason (the task's fault or the worker's, not the policy's)."""
    from tasks.reward_model import scores

    first = items[0][0].verifier.data
    try:
        raw = scores(model, [t for t, _ in items], [c for _, c in items], int(first.get("max_length", 2048)))
    except Exception as exc:  # noqa: BLE001 - a missing model, a bad checkpoint, out of memory
        return [Verdict(0.0, "error", Feedback(message=f"reward model {model}: {type(exc).__name__}: {exc}")) for _ in items]
    out = []
    for (task, _), x in zip(items, raw):
        data = task.verifier.data
        reward = (x - float(data.get("mean", 0.0))) / float(data.get("std", 1.0) or 1.0)
        if not math.isfinite(reward):
            out.append(Verdict(0.0, "error", Feedback(message=f"reward model {model}: score {x!r} is not finite")))
            continue
        out.append(Verdict(reward, "pass" if reward >= float(data.get("pass_at", 0.0)) else "fail", details={"rm_score": x}))
    return out


def score_registered(
    kind: registry.VerifierKind, items: Sequence[tuple[Task, str]], timeout_s: float | None = None
) -> list[Verdict]:
    """A registered kind's verdicts for its items, from one call of its function; what the
    function does wrong (raises, hangs past ``timeout_s``, wrong count, a reward that is not a
    finite number) scores the samples concerned ``error`` with the reason."""

    def errors(reason: str) -> list[Verdict]:
        return [Verdict(0.0, "error", Feedback(message=f"verifier {kind.name}: {reason}")) for _ in items]

    tasks, completions = [t for t, _ in items], [c for _, c in items]
    try:
        fn = kind.function()
        if kind.style == "trl":
            fields: dict[str, list] = {key: [] for t in tasks for key in t.verifier.data}
            for key in fields:
                fields[key] = [t.verifier.data.get(key) for t in tasks]
            got = list(
                within(lambda: fn([registry.prompt_of(t) for t in tasks], completions, **fields), timeout_s, "verifier-call")
            )
        else:
            got = list(within(lambda: fn(tasks, completions), timeout_s, "verifier-call"))
    except Hung as exc:
        return errors(str(exc))
    except Exception as exc:  # noqa: BLE001 - a user's function fails in any way; the service carries on
        return errors(f"raised {type(exc).__name__}: {exc}")
    if len(got) != len(items):
        return errors(f"returned {len(got)} results for {len(items)} samples")
    out = []
    for g in got:
        if isinstance(g, Verdict):
            reward, verdict, feedback = g.reward, g.verdict, g.feedback
        elif kind.style == "verdict" and isinstance(g, tuple) and len(g) in (2, 3):
            reward, verdict = g[0], g[1]
            feedback = Feedback(message=str(g[2])) if len(g) == 3 and g[2] else None
        else:
            reward, verdict, feedback = g, None, None
        x = registry.finite(reward)
        if x is None:
            out.append(Verdict(0.0, "error", Feedback(message=f"verifier {kind.name}: reward {reward!r} is not a finite number")))
            continue
        if verdict not in ("pass", "fail", "error"):
            verdict = "pass" if x >= kind.pass_at else "fail"
        out.append(Verdict(x, verdict, feedback))
    return out


def score_batch(
    sandbox: Sandbox | None, items: Sequence[tuple[Task | None, str]], *, fn_timeout_s: float | None = DEFAULT_FN_TIMEOUT_S
) -> list[Verdict]:
    """Score (task, completion) pairs. Python jobs of the batch share one sandbox launch;
    terminal tasks get a workspace each. A task whose verifier payload is unusable
    scores ``error`` with the reason (it is the task's fault, not the model's).

    ``sandbox`` may be None when no item's kind runs there. ``fn_timeout_s`` bounds each call of
    a user's function (None: unbounded, where something else interrupts it)."""
    out: list[Verdict | None] = [None] * len(items)
    jobs: list[Job] = []
    owners: list[tuple[int, str]] = []  # (item index, how to judge)
    users: dict[str, list[int]] = {}  # a registered kind -> its items, scored in one call
    rms: dict[str, list[int]] = {}  # a reward model -> its items, scored in one forward pass
    judged: list[int] = []  # asked of their judges together, their requests in flight at once
    for i, (task, completion) in enumerate(items):
        try:
            if task is None:
                out[i] = Verdict(0.0, "error", Feedback(message="rollout carries no task: nothing says how to verify it"))
                continue
            kind = task.verifier.kind
            if sandbox is None and registry.where(kind) == "sandbox":
                out[i] = Verdict(0.0, "infra", Feedback(message=f"{kind} runs in the sandbox, and this scorer has none"))
                continue
            if kind == "python_program":
                program = program_of(task, completion)
                if program is None:
                    out[i] = judge(task, completion, None)
                else:
                    jobs.append(Job(program))
                    owners.append((i, kind))
            elif kind == "python_tests":
                jobs.append(_python_tests_job(task, completion))
                owners.append((i, kind))
            elif kind == "math":
                out[i] = judge_math(task, completion)
            elif kind == "terminal":
                out[i] = _terminal(sandbox, task, completion)  # type: ignore[arg-type]
            elif kind == "tool_call":
                out[i] = judge_tool_call(task, completion)
            elif kind == "reward_model":
                if not isinstance(task.verifier.data.get("model"), str):
                    raise VerifierError(f"task {task.task_id}: reward_model verifier needs data.model")
                rms.setdefault(task.verifier.data["model"], []).append(i)
            elif kind == "judge":
                judged.append(i)
            elif kind == "environment":
                out[i] = replay(task, actions_of(completion), sandbox,
                                lambda t, a: score_batch(sandbox, [(t, a)], fn_timeout_s=fn_timeout_s)[0])  # fmt: skip
            else:
                try:
                    registry.get(kind)
                except registry.RegistryError as exc:
                    raise VerifierError(f"task {task.task_id}: {exc}") from None
                users.setdefault(kind, []).append(i)
        except VerifierError as exc:
            out[i] = Verdict(0.0, "error", Feedback(message=f"bad task: {exc}"))
    for model, idxs in rms.items():
        for i, v in zip(idxs, _reward_model_verdicts(model, [items[i] for i in idxs])):
            out[i] = v
    if judged:
        for i, v in zip(judged, judge_verdicts([items[i] for i in judged])):  # type: ignore[misc]
            out[i] = v
    for kind, idxs in users.items():
        for i, v in zip(idxs, score_registered(registry.get(kind), [items[i] for i in idxs], fn_timeout_s)):
            out[i] = v
    if jobs:
        unique = list(dict.fromkeys(jobs))  # identical (program, tests) pairs run once
        by_job = dict(zip(unique, sandbox.run(unique)))  # type: ignore[union-attr]
        for job, (i, kind) in zip(jobs, owners):
            task, completion = items[i]
            result = by_job[job]
            out[i] = judge(task, completion, result) if kind == "python_program" else _tests_reward(task.verifier.data, result)
    assert all(v is not None for v in out)
    return out  # type: ignore[return-value]
