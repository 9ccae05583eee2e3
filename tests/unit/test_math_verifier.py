"""Math answers: extraction and normalisation (no sandbox involved)."""

from __future__ import annotations

import pytest

from conveyor.contracts import Task, VerifierSpec
from tasks.math_answers import extract_answer, judge_math
from tasks.verdict import VerifierError


def task(answer, **kw):
    return Task(task_id="m", run_id="r", prompt="?", verifier=VerifierSpec(kind="math", data={"answer": answer, **kw}))


@pytest.mark.parametrize(
    "answer,completion",
    [
        ("3/4", r"so it is \boxed{\frac{3}{4}}."),
        ("0.75", r"\boxed{\dfrac{3}{4}}"),
        ("1000", "#### 1,000"),
        ("42", "The answer is: 42."),
        ("-2.5", "first 3, then 7, finally -2.5"),
        ("12", r"\boxed{\text{12}}"),
        ("50%", "the answer is 50%"),
        ("x+1", r"\boxed{X + 1}"),
        ("0.5", "answer: 0.4999999999"),
        ("5", r"\boxed{{5}}"),
    ],
)
def test_correct_answers_pass(answer, completion):
    v = judge_math(task(answer), completion)
    assert (v.reward, v.verdict) == (1.0, "pass")


@pytest.mark.parametrize(
    "answer,completion",
    [("7", "I think 8"), ("3/4", r"\boxed{4/3}"), ("100", "no number at all"), ("0.5", "0.51"), ("1000", "#### 100")],
)
def test_wrong_answers_fail_with_feedback(answer, completion):
    v = judge_math(task(answer), completion)
    assert (v.reward, v.verdict) == (0.0, "fail")
    assert v.feedback is not None and v.feedback.message


def test_the_last_boxed_answer_counts():
    assert extract_answer(r"first \boxed{1} then \boxed{2}") == "2"


def test_tolerance_is_configurable():
    assert judge_math(task("0.5", tolerance=0.05), "0.51").reward == 1.0


def test_missing_ground_truth_is_the_tasks_fault():
    bad = Task(task_id="m", run_id="r", prompt="?", verifier=VerifierSpec(kind="math", data={}))
    with pytest.raises(VerifierError, match="data.answer"):
        judge_math(bad, "1")


@pytest.mark.parametrize(
    ("answer", "completion", "verdict"),
    [
        ("\\frac{1}{2}", "so the answer is $\\dfrac12$", "pass"),
        ("\\sqrt{8}", "\\boxed{2\\sqrt{2}}", "pass"),
        ("2\\sqrt{3}", "The answer is \\sqrt{12}", "pass"),
        ("(1,3)", "\\boxed{(1, 3)}", "pass"),
        ("\\frac{\\pi}{2}", "\\boxed{\\pi/2}", "pass"),
        ("x^2-1", "\\boxed{(x-1)(x+1)}", "pass"),
        ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", "pass"),
        ("\\sqrt{8}", "\\boxed{3}", "fail"),
        ("(1,3)", "\\boxed{[1,3]}", "fail"),
        ("x+1", "\\boxed{x-1}", "fail"),
        ("\\frac{1}{3}", "\\boxed{0.33}", "fail"),
    ],
)
def test_answers_equal_as_mathematics_pass(answer, completion, verdict):
    assert judge_math(task(answer), completion).verdict == verdict


def test_off_the_main_thread_a_runaway_answer_is_not_compared():
    import threading

    from tasks.math_answers import symbolically_equal

    out = {}
    worker = threading.Thread(
        target=lambda: out.update(
            tower=symbolically_equal("1", "9^{9^{9^{9}}}"), ok=symbolically_equal("\\sqrt{8}", "2\\sqrt{2}")
        )
    )
    worker.start()
    worker.join(30)
    assert out == {"tower": False, "ok": True}
