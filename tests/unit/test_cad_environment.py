"""The built-in CAD environment: the model's JSON tool calls build a solid (Manifold's geometry), and
the reward checks its volume, bounding box and through-holes against the task's target. Calls are
validated against the tools' schemas; a refused call says why and changes nothing."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tasks import cad, environments
from tasks.suites import cad as suite

pytestmark = pytest.mark.unit

PLATE = cad.plate_calls(40, 20, 5, [(-10, 0, 2), (10, 0, 2)])


def turns(calls: list[dict]) -> list[str]:
    return [json.dumps(c) for c in calls]


def plate_task():
    return cad.task("t", "r", "a plate with two holes", PLATE)


@pytest.mark.parametrize("problem", suite.problems(), ids=lambda p: p.id)
def test_each_suite_part_built_by_its_reference_calls_passes(problem):
    task = suite.to_task(problem, "r", 4, 0)
    target = task.verifier.data["target"]
    assert set(target) == {"volume", "bbox", "holes"} and target["volume"] > 0
    assert task.tools == cad.TOOLS and task.max_turns > 1 and environments.problem("cad") is None
    verdict = environments.replay(task, [*turns(list(problem.calls)), "done"])
    assert (verdict.verdict, verdict.reward) == ("pass", 1.0)


def test_a_part_short_of_the_target_gets_partial_credit_and_fails():
    one_hole = cad.plate_calls(40, 20, 5, [(-10, 0, 2)])
    verdict = environments.replay(plate_task(), turns(one_hole))
    # bbox right, volume within 2% (a hole is 0.3% of it), one hole short
    assert verdict.verdict == "fail" and verdict.reward == pytest.approx(2 / 3)
    thick = cad.plate_calls(40, 20, 6, [(-10, 0, 2), (10, 0, 2)])
    assert environments.replay(plate_task(), turns(thick)).reward == pytest.approx(1 / 3)  # holes right only
    assert environments.replay(plate_task(), ["done"]).reward == 0.0  # no part at all


def test_booleans_and_the_openai_call_format():
    env = environments.make("cad")
    env.reset(plate_task())
    for text in turns(PLATE[:-1]):
        env.step(text)
    env.step(json.dumps({"type": "function", "function": {"name": "extrude",
                         "arguments": json.dumps({"sketch": "s", "height": 5, "name": "a"})}}))  # fmt: skip
    assert env.reward() == 1.0
    env.step('```json\n{"name": "new_sketch", "arguments": {"name": "cutter"}}\n```')
    env.step(json.dumps({"name": "add_rect", "arguments": {"sketch": "cutter", "width": 10, "height": 30}}))
    env.step(json.dumps({"name": "extrude", "arguments": {"sketch": "cutter", "height": 10, "z": -1, "name": "c"}}))
    step = env.step(json.dumps({"name": "boolean", "arguments": {"op": "difference", "a": "a", "b": "c", "name": "two"}}))
    # the plate cut in two through its middle: two pieces, each with its hole
    assert "bounding box 40.000 x 20.000 x 5.000" in step.observation and "through-holes 2" in step.observation
    assert env.reward() == pytest.approx(2 / 3)  # less volume


@pytest.mark.parametrize(
    "turn, says",
    [
        ("make me a plate", "not a JSON tool call"),
        ('{"name": "drill", "arguments": {}}', "unknown tool 'drill'"),
        ('{"name": "extrude", "arguments": {"sketch": "s", "height": -1, "name": "a"}}', "extrude: height"),
        ('{"name": "extrude", "arguments": {"sketch": "s", "height": 1, "name": "a", "colour": "red"}}', "colour"),
        ('{"name": "extrude", "arguments": {"sketch": "nope", "height": 1, "name": "a"}}', "no sketch named 'nope'"),
        ('{"name": "add_circle", "arguments": {"sketch": "s", "radius": 1e300}}', "add_circle: radius"),
        ('{"name": "boolean", "arguments": {"op": "intersection", "a": "part", "b": "far", "name": "x"}}', "'far'"),
        ('{"name": "new_sketch", "arguments": {"name": "has space"}}', "new_sketch: name"),
        ('["new_sketch"]', 'expected {"name": TOOL'),
    ],
)
def test_a_refused_call_says_why_and_changes_nothing(turn, says):
    env = environments.make("cad")
    env.reset(plate_task())
    for text in turns(PLATE):
        env.step(text)
    before = cad.properties(env.model.part)
    step = env.step(turn)
    assert step.observation.startswith("refused:") and says in step.observation, step.observation
    assert not step.done and cad.properties(env.model.part) == before and step.reward == 1.0


def test_an_empty_result_is_refused():
    env = environments.make("cad")
    env.reset(plate_task())
    for text in turns(PLATE):
        env.step(text)
    step = env.step(json.dumps({"name": "boolean", "arguments": {"op": "difference", "a": "part", "b": "part", "name": "x"}}))
    assert "x would be empty" in step.observation


def test_the_tools_are_valid_json_schemas_in_openais_format():
    for tool in cad.TOOLS:
        assert tool["type"] == "function" and tool["function"]["description"]
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])


def test_a_task_without_a_target_scores_error():
    bad = plate_task()
    import msgspec

    bad = msgspec.structs.replace(bad, verifier=msgspec.structs.replace(bad.verifier, data={"environment": "cad"}))
    verdict = environments.replay(bad, turns(PLATE))
    assert verdict.verdict == "error" and "target needs volume" in verdict.feedback.message


async def test_the_worker_drives_a_cad_episode_and_the_bridge_replays_it(tmp_path):
    """A tiny random model cannot write a tool call: every turn is refused with the reason, as a
    tool turn, and the replayed episode scores 0 (no part), through the worker and the bridge."""
    from learner.models import create_tiny_llama
    from reward.bridge import RewardBridge
    from reward.scorers import LocalScorer
    from rollout_workers.reference_engine import ReferenceEngine
    from tasks.suites.pyexpr import ALPHABET
    from tests.unit.test_rollout_worker import _pipeline

    create_tiny_llama(tmp_path / "m", ALPHABET, seed=3, hidden_size=32, layers=2, heads=2, intermediate_size=64,
                      max_positions=512)  # fmt: skip
    engine = ReferenceEngine(tmp_path / "m", seed=0)
    t = plate_task()
    kw = {"prompt": "Build it.", "max_turns": 3, "verifier": t.verifier, "tools": cad.TOOLS, "sampling": None}
    worker, rollouts, committed, error = await _pipeline(tmp_path, engine, n_tasks=1, task_kw=kw)
    assert error is None and rollouts
    for r in rollouts:
        assert [x.role for x in r.turns] == ["assistant", "tool"] * 2 + ["assistant"]
        assert all(x.text.startswith("refused: not a JSON tool call") for x in r.turns if x.role == "tool")
    scored = await RewardBridge(None, None, LocalScorer(None), engine.decode).score(rollouts)
    assert all((s.reward, s.verdict) == (0.0, "fail") for s in scored)
