"""Verifiers: turn a completion and what the sandbox saw into a reward.

``python_program``: the program is ``task.prompt + completion``; it passes
when it exits 0 in the sandbox. ``data.answer_format == "int_literal"``
first requires the completion to be an integer literal (a format check, as
math verifiers normalise answers): without it the policy learns to write
``x`` or to copy the expression, which passes every assert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from conveyor.contracts import Feedback, Task
from reward.sandbox import ExecResult

_INT_LITERAL = re.compile(r"^ ?-?\d+\n?$")


@dataclass(frozen=True)
class Verdict:
    reward: float
    verdict: str
    feedback: Feedback | None


def program_of(task: Task, completion: str) -> str | None:
    """The program to execute, or None when the completion fails the format check."""
    fmt = task.verifier.data.get("answer_format")
    if fmt == "int_literal" and not _INT_LITERAL.match(completion):
        return None
    return (task.prompt or "") + completion


def judge(task: Task, completion: str, result: ExecResult | None) -> Verdict:
    """``result`` is None when ``program_of`` refused the completion."""
    if result is None:
        return Verdict(0.0, "fail", Feedback(message="the answer must be an integer literal", text=completion[:200]))
    if result.verdict == "pass":
        return Verdict(1.0, "pass", None)
    fb = result.feedback or {}
    feedback = Feedback(
        exception_type=fb.get("type"),
        message=fb.get("message") or result.stderr[-300:] or None,
        line=fb.get("line"),
        text=result.stderr[-1000:],
    )
    return Verdict(0.0, result.verdict if result.verdict != "infra" else "infra", feedback)
