"""Built-in task suites: every reference solution passes its own verifier, every wrong one scores 0.

Each suite is scored in one ``score_batch`` call through the real sandbox
(python_functions: one sandbox launch for the batch; terminal: a workspace
per task). The wrong answers scoring 0 also shows that no task is passed by
accident (an untouched workspace, a function returning None).
"""

from __future__ import annotations

import importlib

import pytest
from conftest import open_sandbox

from conveyor.contracts import Task

SUITES = {"python_functions": 40, "terminal": 20, "math_numeric": 30, "tool_calls": 20, "cad": 15}
KINDS = {"python_functions": "python_tests", "terminal": "terminal", "math_numeric": "math", "tool_calls": "tool_call",
         "cad": "environment"}  # fmt: skip


@pytest.fixture(scope="module")
def sandbox():
    sb = open_sandbox(timeout_s=10.0)
    yield sb
    sb.close()


def suite(name):
    return importlib.import_module(f"tasks.suites.{name}")


@pytest.mark.parametrize("name", SUITES)
def test_suite_shape(name):
    mod = suite(name)
    problems = mod.problems()
    assert len(problems) >= SUITES[name]
    ids = [p.id for p in problems]
    assert len(set(ids)) == len(ids), "problem ids must be unique"
    assert {p.difficulty for p in problems} <= {1, 2, 3} and len({p.difficulty for p in problems}) == 3
    train = {p.id for p in problems if p.split == "train"}
    heldout = {p.id for p in problems if p.split == "heldout"}
    assert heldout and train and not heldout & train and train | heldout == set(ids)
    assert [p.split for p in mod.problems()] == [p.split for p in problems]  # deterministic
    tasks = [mod.to_task(p, "run-1", 4, i) for i, p in enumerate(problems)]
    assert all(isinstance(t, Task) and t.verifier.kind == KINDS[name] for t in tasks)
    assert all(t.split == p.split and t.group_size == 4 and t.metadata["problem_id"] == p.id for t, p in zip(tasks, problems))
    assert len({t.task_id for t in tasks}) == len(tasks)
    assert all(p.reference != p.wrong for p in problems)


@pytest.mark.parametrize("name", SUITES)
def test_reference_passes_and_wrong_scores_zero(sandbox, name):
    from tasks.verifiers import score_batch

    mod = suite(name)
    problems = mod.problems()
    items = []
    for i, p in enumerate(problems):
        task = mod.to_task(p, "run-1", 1, i)
        items += [(task, p.reference), (task, p.wrong)]
    verdicts = score_batch(sandbox, items)
    bad = []
    for p, good, wrong in zip(problems, verdicts[0::2], verdicts[1::2]):
        if (good.reward, good.verdict) != (1.0, "pass"):
            bad.append(f"{p.id}: reference scored {good.reward} ({good.verdict}): {good.feedback}")
        if wrong.reward != 0.0 or wrong.verdict == "pass":
            bad.append(f"{p.id}: wrong answer scored {wrong.reward} ({wrong.verdict})")
        elif wrong.verdict == "error" and (wrong.feedback.message or "").startswith("bad task"):
            bad.append(f"{p.id}: wrong answer hit a task error: {wrong.feedback.message}")
    assert not bad, "\n".join(bad)


def test_math_suite_is_reproducible_from_its_seed():
    mod = suite("math_numeric")
    a, b, c = mod.problems(), mod.problems(), mod.problems(seed=mod.SEED + 1)
    assert [(p.question, p.answer) for p in a] == [(p.question, p.answer) for p in b]
    assert [p.question for p in a] != [p.question for p in c]
    assert all(p.reference.endswith(f"\\boxed{{{p.answer}}}.") for p in a)
