"""Held-out evaluation: the unbiased pass@k estimator, and a model's completions judged by the
tasks' own verifiers through the engine a rollout worker serves."""

from __future__ import annotations

import asyncio
import json
from math import comb

import pytest

from conveyor.config import RolloutConfig
from conveyor.contracts import Task, VerifierSpec
from learner.models import create_tiny_llama
from rollout_workers.engines import open_engine
from rollout_workers.evaluation import evaluate, pass_at_k
from tasks.math_answers import judge_math
from tests.cli import invoke

ALPHABET = "0123456789+-*() =\n"


@pytest.mark.parametrize(("n", "c", "k"), [(5, 2, 1), (5, 2, 2), (10, 3, 4), (4, 0, 2), (4, 4, 3), (6, 5, 2)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(3, 4, 1), (3, 1, 4), (3, 1, 0)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("m") / "model"
    create_tiny_llama(model_dir, ALPHABET, hidden_size=32, layers=1, intermediate_size=64)
    return model_dir


def math_tasks(answers: list[str]) -> list[Task]:
    return [
        Task(task_id=f"t{i}", run_id="eval", prompt=f"{i}+{i}=", verifier=VerifierSpec(kind="math", data={"answer": a}))
        for i, a in enumerate(answers)
    ]


def run(model_dir, *calls: tuple[list[Task], dict]):
    """Each ``(tasks, options)`` evaluated in turn by one engine (it lives in one event loop)."""

    async def main():
        engine = open_engine(RolloutConfig(engine="reference", seed=0), model_dir)
        await engine.start()
        try:
            return [await evaluate(engine, None, tasks, max_tokens=8, **kw) for tasks, kw in calls]
        finally:
            await engine.close()

    return asyncio.run(main())


def test_each_completion_is_judged_by_its_tasks_verifier(model_dir):
    tasks = math_tasks([str(d) for d in range(10)])
    (report,) = run(model_dir, (tasks, {"samples": 3, "temperature": 1.0}))
    assert report.tasks == 10 and report.samples_per_task == 3
    for task, result in zip(tasks, report.per_task):
        assert result.task_id == task.task_id
        assert result.verdicts == [judge_math(task, text).verdict for text in result.completions]
        assert result.passed == result.verdicts.count("pass")
        assert all(0 < n <= 8 for n in result.tokens)
    assert report.mean_reward == pytest.approx(sum(sum(r.rewards) for r in report.per_task) / 30)


def test_one_sample_is_greedy_and_repeats_itself(model_dir):
    tasks = math_tasks(["1", "2"])
    first, again = run(model_dir, (tasks, {}), (tasks, {}))
    assert [r.completions for r in first.per_task] == [r.completions for r in again.per_task]
    assert first.pass_at_1 == first.pass_at_k == sum(r.passed for r in first.per_task) / 2


def test_pass_at_k_from_several_samples_per_task(model_dir):
    (report,) = run(model_dir, (math_tasks(["1", "2", "3"]), {"k": 2, "samples": 4, "temperature": 1.0}))
    assert report.samples_per_task == 4 and all(len(r.verdicts) == 4 for r in report.per_task)
    assert report.pass_at_k == pytest.approx(sum(pass_at_k(4, r.passed, 2) for r in report.per_task) / 3)
    assert report.pass_at_1 <= report.pass_at_k
    assert json.loads(json.dumps(report.to_json()))["per_task"][0]["task_id"] == "t0"
    with pytest.raises(ValueError, match="k <= samples"):
        run(model_dir, (math_tasks(["1"]), {"k": 3, "samples": 2}))


def test_the_eval_command_reports_and_refuses_bad_input(monkeypatch, model_dir, tmp_path):

    data = tmp_path / "heldout.jsonl"
    rows = [
        {"task_id": f"h{i}", "prompt": f"{i}+1=", "verifier": {"kind": "math", "data": {"answer": str(i + 1)}}} for i in range(3)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok = invoke(
        monkeypatch,
        [
            "eval",
            "--data",
            str(data),
            "--model",
            str(model_dir),
            "--k",
            "2",
            "--max-tokens",
            "6",
            "--out",
            str(tmp_path / "r.json"),
        ],
    )
    assert ok.exit_code == 0, ok.output
    assert "FIGURE eval_pass_at_k" in ok.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["tasks"] == 3 and report["samples_per_task"] == 2 and len(report["per_task"][0]["completions"]) == 2
    bad = invoke(monkeypatch, ["eval", "--data", str(data), "--model", "acme/not-cached-here"], env={"HF_HUB_OFFLINE": "1"})
    assert bad.exit_code == 2 and "acme/not-cached-here" in bad.output
    neither = invoke(monkeypatch, ["eval", "--data", str(data)])
    assert neither.exit_code == 2 and "--model or --run" in neither.output
