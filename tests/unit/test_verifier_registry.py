"""Verifiers users plug in: a TRL-style reward function or a verdict function, registered in code,
by the run config or by an entry point, scored beside the built-in kinds; a function that
misbehaves scores ``error`` for its samples and nothing else stops."""

from __future__ import annotations

import math

import pytest

from conveyor.contracts import ChatMessage, Task, VerifierSpec
from tasks import registry
from tasks.verifiers import Verdict, score_batch


# A custom reward, as a TRL user writes one: prompts, completions, the dataset's columns.
def length_reward(prompts, completions, target, **_):
    return [1.0 if len(c) == t else -abs(len(c) - t) / 10 for c, t in zip(completions, target)]


def says_why(tasks, completions):
    return [(1.0, "pass") if "42" in c else (0.0, "fail", "the answer is not 42") for c in completions]


@pytest.fixture(autouse=True)
def _clean():
    yield
    for name in ("length", "why", "broken", "miscount", "nan", "configured"):
        registry.unregister(name)


def task(kind: str, i: int = 0, **data) -> Task:
    return Task(task_id=f"t{i}", run_id="r", prompt=f"p{i}", verifier=VerifierSpec(kind=kind, data=data))


def test_a_trl_style_reward_scores_beside_the_built_in_kinds():
    registry.register("length", length_reward, required=["target"])
    items = [(task("length", 0, target=3), "abc"), (task("math", 1, answer="4"), "4"), (task("length", 2, target=3), "abcdef")]
    out = score_batch(None, items)
    assert [(v.reward, v.verdict) for v in out] == [(1.0, "pass"), (1.0, "pass"), (-0.3, "fail")]
    assert "length" in registry.known() and registry.get("length").required == ("target",)


def test_prompts_reach_the_function_as_text_or_chat_messages():
    seen = {}
    registry.register("why", lambda prompts, completions, **kw: seen.setdefault("p", prompts) and [0.0] * len(prompts))
    chat = Task(task_id="c", run_id="r", messages=[ChatMessage(role="user", content="hi")], verifier=VerifierSpec(kind="why"))
    score_batch(None, [(task("why"), "x"), (chat, "y")])
    assert seen["p"] == ["p0", [{"role": "user", "content": "hi"}]]


def test_a_verdict_function_says_why():
    registry.register("why", says_why, style="verdict")
    good, bad = score_batch(None, [(task("why"), "it is 42"), (task("why", 1), "41")])
    assert (good.reward, good.verdict) == (1.0, "pass")
    assert (bad.verdict, bad.feedback.message) == ("fail", "the answer is not 42")


def test_a_function_that_misbehaves_scores_error_and_the_rest_is_scored():
    def broken(prompts, completions, **_):
        raise RuntimeError("model server down")

    registry.register("broken", broken)
    registry.register("miscount", lambda prompts, completions, **_: [1.0])
    registry.register("nan", lambda prompts, completions, **_: [math.nan, 1.0])
    out = score_batch(None, [(task("broken"), "a"), (task("miscount", 1), "b"), (task("miscount", 2), "c"),
                             (task("nan", 3), "d"), (task("nan", 4), "e"), (task("math", 5, answer="1"), "1")])  # fmt: skip
    assert [v.verdict for v in out] == ["error", "error", "error", "error", "pass", "pass"]
    assert "raised RuntimeError: model server down" in out[0].feedback.message
    assert "returned 1 results for 2 samples" in out[1].feedback.message
    assert "not a finite number" in out[3].feedback.message


def test_an_unknown_kind_scores_error_naming_the_known_ones():
    [v] = score_batch(None, [(task("nope"), "x")])
    assert v.verdict == "error" and "unknown verifier kind 'nope'" in v.feedback.message and "math" in v.feedback.message


def test_the_run_config_registers_by_module_path_and_bad_entries_fail_at_start():
    from conveyor.config import parse_run_config

    cfg = parse_run_config({"reward": {"verifiers": {"configured": {"fn": f"{__name__}:says_why", "style": "verdict"}}}})
    registry.configure(cfg.reward.verifiers)
    assert registry.get("configured").function() is says_why
    with pytest.raises(registry.RegistryError, match="cannot import 'no_such_module:f'"):
        registry.configure({"length": "no_such_module:f"})
    with pytest.raises(registry.RegistryError, match="built in"):
        registry.register("math", length_reward)
    with pytest.raises(registry.RegistryError, match="give fn"):
        registry.configure({"length": {"style": "trl"}})


def test_task_files_and_the_http_api_accept_registered_kinds_only(tmp_path):
    import json

    from pydantic import ValidationError

    from producers.api import VerifierIn
    from producers.loaders import load_tasks

    path = tmp_path / "t.jsonl"
    rows = [{"task_id": "a", "prompt": "p", "verifier": {"kind": "length", "data": {"target": 3}}},
            {"task_id": "b", "prompt": "p", "verifier": {"kind": "length", "data": {}}}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    unknown = load_tasks(path, "r", on_error="skip")
    assert [e.reason for e in unknown.errors][0].startswith("unknown verifier kind 'length'; known: python_program")
    with pytest.raises(ValidationError, match="unknown verifier kind 'length'"):
        VerifierIn(kind="length")
    registry.register("length", length_reward, required=["target"])
    known = load_tasks(path, "r", on_error="skip")
    assert [t.task_id for t in known.tasks] == ["a"] and "target" in known.errors[0].reason
    assert VerifierIn(kind="length").kind == "length"


def test_verdicts_are_the_verifiers_type():
    registry.register("why", lambda tasks, completions: [Verdict(0.5, "fail")], style="verdict")
    [v] = score_batch(None, [(task("why"), "x")])
    assert (v.reward, v.verdict) == (0.5, "fail")


def test_a_function_that_hangs_scores_error_past_its_limit_and_the_rest_are_scored():
    import threading

    release = threading.Event()
    registry.register("hangs", lambda prompts, completions, **_: release.wait(30) and [1.0] * len(completions))
    try:
        out = score_batch(None, [(task("hangs", 0), "a"), (task("math", 1, answer="4"), "4")], fn_timeout_s=0.3)
        assert out[0].verdict == "error" and "did not return within 0.3 s" in out[0].feedback.message
        assert (out[1].reward, out[1].verdict) == (1.0, "pass")
    finally:
        release.set()
        registry.unregister("hangs")


def test_sandbox_kinds_without_a_sandbox_are_infra_not_a_crash():
    [v] = score_batch(None, [(task("python_program", 0), "1")])
    assert v.verdict == "infra" and "sandbox" in v.feedback.message
