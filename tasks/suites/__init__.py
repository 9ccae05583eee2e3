"""Built-in task suites (written for this project; nothing is downloaded).

The finite suites share two rules: the held-out split is chosen by a hash of
the problem id (about 20 %, stable when problems are added), and a task is
one problem at one stream position (``<suite>-<problem>-<index>``).
"""

from __future__ import annotations

import hashlib

from conveyor.contracts import ChatMessage, SamplingParams, Task, VerifierSpec


def split_of(suite: str, problem_id: str) -> str:
    return "heldout" if hashlib.sha256(f"{suite}/{problem_id}".encode()).digest()[0] < 52 else "train"


def suite_task(
    suite: str,
    problem,
    run_id: str,
    group_size: int,
    index: int,
    *,
    verifier: VerifierSpec,
    max_tokens: int,
    prompt: str | None = None,
    messages: list[ChatMessage] | None = None,
) -> Task:
    """The Task for ``problem`` (with ``id``, ``split``, ``difficulty``) at stream position ``index``."""
    return Task(
        task_id=f"{suite}-{problem.id}-{index:07d}",
        run_id=run_id,
        prompt=prompt,
        messages=messages,
        verifier=verifier,
        group_size=group_size,
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens),
        split=problem.split,
        metadata={"suite": suite, "problem_id": problem.id, "difficulty": str(problem.difficulty)},
    )
