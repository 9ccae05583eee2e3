"""The judge verifier's reading of a judge's answer and its refusals, without an endpoint: what a
judge says becomes a reward on [0, 1] or an ``error`` verdict with the reason, never a zero."""

from __future__ import annotations

import pytest

from conveyor.contracts import ChatMessage, Task, VerifierSpec
from conveyor.reward_config import JudgeConfig
from tasks import judge
from tasks.verifiers import score_batch

CFG = JudgeConfig(url="http://127.0.0.1:9/v1", model="m", score_min=0, score_max=10, pass_at=0.7)


@pytest.fixture(autouse=True)
def _judges():
    judge.configure({"default": CFG})
    yield
    judge.configure({})


def task(i: int = 0, **data) -> Task:
    return Task(task_id=f"t{i}", run_id="r", prompt="What is 2+2?", verifier=VerifierSpec(kind="judge", data=data))


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("Correct and concise.\nScore: 9", 9.0),
        ("score=7.5", 7.5),
        ("First thought Score: 2, on reflection\nScore: **8**", 8.0),
        ('{"score": 4, "reason": "partly"}', 4.0),
        ('```json\n{"score": 10}\n```', 10.0),
        ("I cannot grade this.", None),
        ('{"score": "high"}', None),
        ('{"score": true}', None),
    ],
)
def test_the_score_is_read_from_the_last_score_line_or_json(answer, score):
    assert judge.parse_score(answer) == score


def test_a_score_maps_onto_zero_one_and_the_reasoning_is_the_feedback():
    v = judge.verdict_of(8.0, "It adds correctly.\nScore: 8", CFG, "default")
    assert (v.reward, v.verdict, v.details) == (0.8, "pass", {"judge_score": 8.0})
    assert v.feedback.text == "It adds correctly."
    assert judge.verdict_of(6.0, "Score: 6", CFG, "default").verdict == "fail"  # below pass_at 0.7


@pytest.mark.parametrize(("score", "why"), [(None, "answered no score"), (11.0, "off its scale"), (-1.0, "off its scale")])
def test_no_score_or_one_off_the_scale_is_an_error_not_a_zero(score, why):
    v = judge.verdict_of(score, "whatever", CFG, "default")
    assert v.verdict == "error" and why in v.feedback.message


def test_a_task_without_a_rubric_or_naming_an_unknown_judge_is_a_bad_task():
    no_rubric, unknown = score_batch(None, [(task(0), "4"), (task(1, rubric="r", judge="nope"), "4")])
    assert no_rubric.verdict == "error" and "needs data.rubric" in no_rubric.feedback.message
    assert (
        unknown.verdict == "error"
        and "no judge named 'nope'" in unknown.feedback.message
        and "default" in unknown.feedback.message
    )


def test_the_judge_sees_rubric_conversation_reference_and_response():
    chat = Task(task_id="c", run_id="r", messages=[ChatMessage(role="user", content="Name a prime.")],
                verifier=VerifierSpec(kind="judge", data={"rubric": "Any prime is right.", "reference": "7"}))  # fmt: skip
    system, user = judge.messages_for(chat, "11", CFG)
    assert "between 0 and 10" in system["content"]
    for part in ("# Rubric\nAny prime is right.", "[user] Name a prime.", "# Reference answer\n7", "# Response to grade\n11"):
        assert part in user["content"]


def test_the_run_config_refuses_a_judge_that_would_outlast_the_tasks_soft_limit():
    from conveyor.config import RunConfig
    from conveyor.errors import ConfigError

    judges = {"slow": {"url": "http://x/v1", "model": "m", "timeout_s": 30, "max_retries": 1}}
    with pytest.raises((ConfigError, ValueError), match="judges.slow: timeout_s x"):
        RunConfig.model_validate({"run_id": "r", "reward": {"soft_time_limit_s": 60, "hard_time_limit_s": 90, "judges": judges}})
    RunConfig.model_validate({"run_id": "r", "reward": {"soft_time_limit_s": 61, "hard_time_limit_s": 90, "judges": judges}})


def test_the_run_config_refuses_a_judge_with_an_empty_scale():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="score_min < score_max"):
        JudgeConfig(url="http://x/v1", model="m", score_min=5, score_max=5)
