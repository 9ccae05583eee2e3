"""The ``tools`` environment: the task's tools, validated and executed, their results fed back as
tool turns, the answer scored by the verifier the task names; refused where tasks come in when a
tool has no code behind it."""

from __future__ import annotations

import json
import re
import time

import pytest

from conveyor.contracts import ChatMessage, SamplingParams, Task, VerifierSpec
from tasks import environments, tool_env
from tasks.environments import Episode
from tasks.verifiers import score_batch

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}  # fmt: skip
LOOKUP = {"name": "lookup", "description": "An order's status.",
          "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}  # fmt: skip
ORDERS = {"123": {"status": "shipped", "items": 2}}


def _lookup(order_id: str) -> dict:
    return ORDERS[order_id]  # KeyError for an unknown order: the model reads it


def _slow(**_: object) -> str:
    time.sleep(5)
    return "late"


@pytest.fixture(autouse=True)
def implementations():
    tool_env.register("add", lambda a, b: a + b)
    tool_env.register("lookup", _lookup)
    yield
    for name in ("add", "lookup", "slow"):
        tool_env.unregister(name)


def _task(answer="5", tools=(ADD, LOOKUP), **data) -> Task:
    return Task(task_id="t", run_id="r", prompt="What is 2 + 3?", group_size=2, max_turns=4, tools=list(tools),
                verifier=VerifierSpec(kind="environment", data={"environment": "tools", "answer": {
                    "kind": "math", "data": {"answer": answer}}, **data}))  # fmt: skip


def _score(task: Task, actions: list[str]):
    """The reward service's verdict of an episode (its actions, as the bridge hands them over)."""
    return score_batch(None, [(task, json.dumps(actions))])[0]


@pytest.mark.parametrize(
    "turn, calls",
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', [("add", {"a": 2, "b": 3})]),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>\n'
         '<tool_call>{"name": "lookup", "arguments": "{\\"order_id\\": \\"123\\"}"}</tool_call>',
         [("add", {"a": 1, "b": 1}), ("lookup", {"order_id": "123"})]),
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}]', [("add", {"a": 2, "b": 3})]),
        ('{"name": "add", "parameters": {"a": 2, "b": 3}}', [("add", {"a": 2, "b": 3})]),
        ('Let me add.\n```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```', [("add", {"a": 2, "b": 3})]),
    ],
)  # fmt: skip
def test_calls_are_read_in_the_formats_models_write(turn, calls):
    assert [(c["name"], c["arguments"]) for c in tool_env.parse_calls(turn)] == calls


def test_a_turn_without_a_call_is_the_answer():
    assert tool_env.parse_calls("The answer is 5.") is None
    assert tool_env.parse_calls("<tool_call>{not json</tool_call>")[0]["error"].startswith("not JSON")


def test_calls_are_executed_and_the_answer_is_scored_by_the_named_verifier():
    episode = Episode(_task())
    try:
        step = episode.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
        assert (step.observation, step.done) == ("5", False)
        assert step.info["tool_calls"] == [{"name": "add", "arguments": {"a": 2, "b": 3}, "ok": True}]
        step = episode.step('<tool_call>{"name": "lookup", "arguments": {"order_id": "123"}}</tool_call>')
        assert json.loads(step.observation) == ORDERS["123"]
        step = episode.step("So the answer is 5.")
        assert step.done and step.answer == "So the answer is 5."
    finally:
        episode.close()
    actions = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "The answer is 5."]
    verdict = _score(_task(), actions)
    assert (verdict.reward, verdict.verdict, verdict.details["env_steps"]) == (1.0, "pass", 2.0)
    wrong = _score(_task(), [*actions[:1], "The answer is 6."])
    assert (wrong.reward, wrong.verdict) == (0.0, "fail")


@pytest.mark.parametrize(
    "turn, says",
    [
        ('<tool_call>{"name": "mul", "arguments": {"a": 2}}</tool_call>', "error: unknown tool 'mul'; the tools are add, lookup"),
        ('<tool_call>{"name": "add", "arguments": {"a": "2", "b": 3}}</tool_call>',
         "error: the arguments of add do not match its schema at $.a: '2' is not of type 'integer'"),
        ('<tool_call>{"name": "add", "arguments": [2, 3]}</tool_call>', "error: the arguments of add must be a JSON object"),
        ('<tool_call>{"name": "lookup", "arguments": {"order_id": "999"}}</tool_call>', "error: lookup raised KeyError: '999'"),
        ("<tool_call>{oops}</tool_call>", "error: not JSON: '{oops}'"),
    ],
)  # fmt: skip
def test_a_bad_call_is_answered_with_the_reason_and_the_episode_goes_on(turn, says):
    episode = Episode(_task())
    try:
        step = episode.step(turn)
        assert step.observation == says and not step.done
        assert [c["ok"] for c in step.info["tool_calls"]] == ([] if "not JSON" in says else [False])
        assert episode.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>').observation == "5"
    finally:
        episode.close()


def test_a_tool_past_its_time_limit_is_an_error_turn():
    tool_env.register("slow", _slow)
    slow = {"name": "slow", "parameters": {"type": "object"}}
    episode = Episode(_task(tools=(ADD, slow), tool_timeout_s=0.2))
    try:
        started = time.monotonic()
        step = episode.step('<tool_call>{"name": "slow", "arguments": {}}</tool_call>')
        assert step.observation == "error: slow did not return within 0.2 s"
        assert time.monotonic() - started < 4  # the episode did not wait for the tool
    finally:
        episode.close()


def test_several_calls_in_a_turn_are_numbered_results_and_results_are_bounded():
    tool_env.register("lookup", lambda order_id: "x" * (tool_env.MAX_RESULT_CHARS + 10))
    episode = Episode(_task())
    try:
        turn = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                '<tool_call>{"name": "lookup", "arguments": {"order_id": "1"}}</tool_call>')  # fmt: skip
        first, second = episode.step(turn).observation.split("\n")
        assert first == "[1] 3" and second.endswith("... [10 more characters]")
    finally:
        episode.close()


def test_the_reward_service_replays_only_the_answer():
    """No tool runs twice for a sample: the replay steps the last action alone."""
    calls = []
    tool_env.register("add", lambda a, b: calls.append((a, b)) or a + b)
    actions = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "5"]
    assert _score(_task(), actions).verdict == "pass" and calls == []
    cut = _score(_task(), actions[:1])  # max_turns ran out on a call: no answer
    assert (cut.reward, cut.verdict) == (0.0, "fail") and "gave no reward" in cut.feedback.message


@pytest.mark.parametrize(
    "tools, data, says",
    [
        ((ADD, {"name": "refund", "parameters": {"type": "object"}}), {}, "tools refund have no implementation here"),
        ((), {}, "the task has none"),
        ((ADD,), {"answer": {"kind": "nope", "data": {}}}, "data.answer.kind: unknown verifier kind 'nope'"),
        ((ADD,), {"answer": {"kind": "math", "data": {}}}, "data.answer.data: math needs answer"),
        ((ADD,), {"answer": {"kind": "environment", "data": {}}}, "an environment cannot score an answer"),
        ((ADD,), {"answer": "5"}, "data.answer: give the verifier of the answer as {kind, data}"),
        ((ADD,), {"tool_timeout_s": 0}, "data.tool_timeout_s: a positive number, got 0"),
    ],
)  # fmt: skip
def test_a_task_the_environment_cannot_run_is_refused_where_tasks_come_in(tools, data, says):
    from producers.api import TaskIn

    full = {"environment": "tools", "answer": {"kind": "math", "data": {"answer": "5"}}, **data}
    assert says in environments.task_problem(full, list(tools) or None)
    body = {"prompt": "2 + 3?", "verifier": {"kind": "environment", "data": full}}
    if tools:
        body["tools"] = list(tools)
    with pytest.raises(ValueError, match=re.escape(says)):
        TaskIn.model_validate(body)


def test_a_task_file_with_an_unimplemented_tool_is_a_rejected_record(tmp_path):
    from producers.loaders import TaskLoader, resolve_mapping

    row = {"prompt": "2 + 3?", "tools": [ADD, {"name": "refund", "parameters": {"type": "object"}}],
           "verifier": {"kind": "environment", "data": {"environment": "tools", "answer": {"kind": "math", "data": {"answer": "5"}}}}}  # fmt: skip
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(dict(row, tools=[ADD])) + "\n")
    loader = TaskLoader(path, "r", resolve_mapping(), on_error="skip")
    tasks = list(loader)
    assert len(tasks) == 1 and tasks[0].tools == [ADD]
    assert "tools refund have no implementation here" in str(loader.errors[0])


def test_tools_are_registered_from_the_run_config_and_a_bad_target_fails_the_start():
    from conveyor.config import parse_run_config
    from conveyor.errors import ConfigError
    from tasks import plugins

    plugins.register(parse_run_config({"reward": {"tools": {"lookup": "tests.unit.test_tool_environment:_lookup"}}}, "t").reward)
    fn = tool_env.implementation("lookup")
    assert (fn.__module__, fn.__name__) == ("tests.unit.test_tool_environment", "_lookup")
    with pytest.raises(ConfigError, match="tool 'refund': cannot import 'tests.unit.test_tool_environment:nope'"):
        plugins.register(parse_run_config({"reward": {"tools": {"refund": "tests.unit.test_tool_environment:nope"}}}, "t").reward)


async def test_a_model_calls_a_tool_through_the_worker_and_the_bridge_scores_its_answer(tmp_path):
    """A tiny chat model taught one episode (call ``add``, read the result, answer) is driven by the
    rollout worker: the call is executed by the registered code (its result, which the model never
    writes, is the tool turn), the call is kept in the turn's record, and the bridge scores the answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reward.bridge import RewardBridge
    from reward.scorers import LocalScorer
    from rollout_workers.reference_engine import ReferenceEngine
    from tests.chat_models import create_tiny_qwen2_chat
    from tests.unit.test_rollout_worker import _pipeline

    tool_env.register("add", lambda a, b: {"sum": a + b})
    model_dir = create_tiny_qwen2_chat(tmp_path / "m", seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [ChatMessage(role="user", content="What is 2 + 3?")]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = ReferenceEngine(model_dir, seed=0)
    prompt = engine.encode_prompt(None, [{"role": "user", "content": "What is 2 + 3?"}], tools=[ADD])
    call_ids = engine.encode(call) + [tok.eos_token_id]
    obs_ids = engine.encode_observation('{"sum": 5}', "tool", chat=True, after=call_ids)
    answer_ids = engine.encode("The answer is 5.") + [tok.eos_token_id]
    ids = torch.tensor([prompt + call_ids + obs_ids + answer_ids])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    torch.manual_seed(0)
    for _ in range(150):  # memorise the one episode
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    model.save_pretrained(model_dir)
    engine = ReferenceEngine(model_dir, seed=0)

    verifier = _task().verifier
    kw = {"prompt": None, "messages": messages, "max_turns": 3, "verifier": verifier, "tools": [ADD],
          "sampling": SamplingParams(temperature=0.0, max_tokens=96)}  # fmt: skip
    worker, rollouts, committed, error = await _pipeline(tmp_path, engine, n_tasks=1, task_kw=kw)
    assert error is None and rollouts
    for r in rollouts:
        assert [t.role for t in r.turns] == ["assistant", "tool", "assistant"]
        assert r.turns[0].text.startswith(call) and r.turns[1].text == '{"sum": 5}'
        assert [(c.name, c.arguments) for c in r.turns[0].tool_calls] == [("add", {"a": 2, "b": 3})]
        assert "The answer is 5." in r.turns[2].text
    scored = await RewardBridge(None, None, LocalScorer(None), engine.decode).score(rollouts)
    assert all((s.reward, s.verdict) == (1.0, "pass") for s in scored)


def test_an_answer_scored_in_the_sandbox_asks_for_the_reward_services_sandbox():
    code = _task()
    code = Task(**{f: getattr(code, f) for f in code.__struct_fields__ if f != "verifier"},
                verifier=VerifierSpec(kind="environment", data={"environment": "tools", "answer": {
                    "kind": "python_tests", "data": {"tests": "assert f() == 5"}}}))  # fmt: skip
    assert environments.needs_sandbox(code) and not environments.needs_sandbox(_task())
    verdict = _score(code, ["def f():\n    return 5\n"])  # no sandbox here: scored infra, retried where one runs
    assert verdict.verdict == "infra"


def test_a_call_nested_too_deep_for_a_record_is_kept_without_its_arguments():
    from rollout_workers.multiturn import _record

    deep: dict = {}
    for _ in range(200):
        deep = {"x": deep}
    assert _record("add", deep).arguments == {"unrecorded": "nested too deep"}
    assert _record("add", {"a": 1}).arguments == {"a": 1}
