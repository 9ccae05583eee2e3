"""Tools that come with the task: checked where tasks come in (a file's record, an HTTP
submission), shown to the model through the chat template, and the schemas the ``tool_call``
verifier validates the model's call against."""

from __future__ import annotations

import json

import pytest

from conveyor.contracts import ChatMessage, Task, VerifierSpec, decode, encode
from tasks.function_tools import tools_problem
from tasks.verifiers import judge_tool_call

pytestmark = pytest.mark.unit

LOOKUP = {"type": "function", "function": {
    "name": "lookup_order", "description": "Find an order by its number.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^[0-9]{6}$"},
                   "include_items": {"type": "boolean"}}, "required": ["order_id"], "additionalProperties": False},
}}  # fmt: skip
REFUND = {"name": "refund", "parameters": {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0}}}}


def task(**data) -> Task:
    return Task(task_id="t", run_id="r", messages=[ChatMessage(role="user", content="Where is order 123456?")],
                tools=[LOOKUP, REFUND], verifier=VerifierSpec(kind="tool_call", data=data))  # fmt: skip


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def test_the_tasks_own_tools_are_the_ones_a_call_is_checked_against():
    t = task(expected={"name": "lookup_order", "arguments": {"order_id": "123456"}})
    assert judge_tool_call(t, call("lookup_order", order_id="123456", include_items=True)).verdict == "pass"
    wrong = judge_tool_call(t, call("lookup_order", order_id="12345"))
    assert wrong.verdict == "fail" and "$.order_id" in wrong.feedback.message
    builtin = judge_tool_call(t, call("get_weather", city="Paris"))  # a built-in tool, not this task's
    assert "unknown tool 'get_weather'; the tools are lookup_order, refund" in builtin.feedback.message
    assert judge_tool_call(t, call("refund", amount=3)).feedback.message == "refund is not the tool this request needs"
    assert decode(encode(t), Task) == t


@pytest.mark.parametrize(
    ("tools", "why"),
    [
        ([], "non-empty list"),
        ([{"description": "no name"}], "tools[0]: needs a name"),
        ([REFUND, REFUND], "'refund' is given twice"),
        ([{"name": "f", "parameters": {"type": "objekt"}}], "tools[0] (f): parameters is not a valid JSON Schema"),
        ([{"name": "f", "parameters": []}], "parameters must be a JSON Schema object"),
    ],
)
def test_unusable_tools_are_refused_naming_the_tool(tools, why):
    assert why in tools_problem(tools)


def test_the_chat_template_is_given_the_tools():
    from conveyor.hf import encode_prompt
    from tests.chat_models import bpe_chat_tokenizer

    tok = bpe_chat_tokenizer()
    tok.chat_template = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}" + tok.chat_template
    t = task()
    text = tok.decode(encode_prompt(tok, None, t.messages, t.tools))
    assert text.startswith("<tools>") and '"name": "lookup_order"' in text and '"name": "refund"' in text
    assert '"type": "function"' in text.split("refund")[0].rsplit("lookup_order", 1)[1]  # the flat one is wrapped too
    assert "<tools>" not in tok.decode(encode_prompt(tok, None, t.messages))


def test_a_task_file_carries_tools_and_a_bad_schema_rejects_the_record(tmp_path):
    from producers.loaders import load_tasks

    good = {"task_id": "a", "messages": [{"role": "user", "content": "Where is 123456?"}], "tools": json.dumps([LOOKUP]),
            "verifier": {"kind": "tool_call", "data": {"expected": {"name": "lookup_order"}}}}  # fmt: skip
    bad = dict(good, task_id="b", tools=[{"name": "f", "parameters": {"type": 3}}])
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, bad)) + "\n")
    result = load_tasks(path, "run", "plain", on_error="skip")
    [a] = result.tasks
    assert a.tools == [LOOKUP]
    [err] = result.errors
    assert err.field == "tools" and "tools[0] (f): parameters is not a valid JSON Schema" in err.reason


def test_an_http_submission_with_a_bad_tool_is_refused_with_the_reason():
    from pydantic import ValidationError

    from producers.api import TaskIn, to_task

    ok = TaskIn.model_validate({"prompt": "p", "tools": [LOOKUP], "verifier": {"kind": "tool_call", "data": {}}})
    assert to_task(ok, "run", 2).tools == [LOOKUP]
    with pytest.raises(ValidationError, match="is given twice"):
        TaskIn.model_validate({"prompt": "p", "tools": [REFUND, REFUND], "verifier": {"kind": "tool_call"}})
