"""The tool_call verifier: parse the call, validate it against the tool's schema, compare with the expected call."""

from __future__ import annotations

import json

import pytest

from conveyor.contracts import Task, VerifierSpec
from tasks.function_tools import TOOLS
from tasks.verifiers import judge_tool_call, score_batch

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
EVENT = {"name": "create_event", "arguments": {"title": "Standup", "start": "2025-04-07T09:30", "duration_minutes": 15,
                                               "attendees": ["ana@example.com", "ben@example.com"]}}  # fmt: skip


def T(expected=WEATHER, **data):
    return Task(task_id="t", run_id="r", prompt="p", verifier=VerifierSpec(kind="tool_call", data={"expected": expected, **data}))


def call(name, **arguments):
    return json.dumps({"name": name, "arguments": arguments})


def judge(completion, task=None):
    return judge_tool_call(task or T(), completion)


def test_schemas_are_valid_json_schema():
    for tool in TOOLS.values():
        tool.validator.check_schema(tool.parameters)


def test_correct_call_passes_bare_or_fenced():
    v = judge(call("get_weather", city="Paris", unit="celsius"))
    assert (v.reward, v.verdict, v.feedback) == (1.0, "pass", None)
    fenced = "I'll check the weather.\n```json\n" + call("get_weather", city="Paris", unit="celsius") + "\n```\nDone."
    assert judge(fenced).reward == 1.0


def test_the_last_fenced_call_counts():
    first, second = call("get_weather", city="Rome"), call("get_weather", city="paris", unit="celsius")
    text = f"```json\n{first}\n```\nNo, Paris:\n```json\n{second}\n```"
    assert judge(text).reward == 1.0


def test_schema_violation_names_the_field():
    v = judge(call("get_weather", city="Paris", unit="kelvin"))
    assert (v.reward, v.verdict) == (0.0, "fail")
    assert "$.unit" in v.feedback.message and "kelvin" in v.feedback.message
    v = judge(call("create_event", title="x", start="2025-04-07T09:30", duration_minutes=15, attendees=["ana@example.com", "nope"]),
              T(EVENT))  # fmt: skip
    assert v.reward == 0.0 and "$.attendees[1]" in v.feedback.message


def test_missing_required_and_unexpected_arguments_are_schema_errors():
    v = judge(call("get_weather", unit="celsius"))
    assert v.reward == 0.0 and "'city' is a required property" in v.feedback.message
    v = judge(call("get_weather", city="Paris", unit="celsius", country="FR"))
    assert v.reward == 0.0 and "country" in v.feedback.message


def test_unknown_tool():
    v = judge(call("get_forecast", city="Paris"))
    assert (v.reward, v.verdict) == (0.0, "fail") and "unknown tool 'get_forecast'" in v.feedback.message


def test_wrong_value_is_rejected_without_revealing_the_answer():
    v = judge(call("get_weather", city="London", unit="celsius"))
    assert (v.reward, v.verdict) == (0.0, "fail")
    assert "'city'" in v.feedback.message and "London" in v.feedback.message and "Paris" not in v.feedback.message


def test_wrong_tool_and_missing_expected_argument():
    v = judge(call("convert_currency", amount=1, **{"from": "EUR", "to": "USD"}))
    assert v.reward == 0.0 and "convert_currency is not the tool" in v.feedback.message
    v = judge(call("get_weather", city="Paris"))  # schema-valid: unit is optional, but the request asked for it
    assert v.reward == 0.0 and "'unit'" in v.feedback.message and "missing" in v.feedback.message


def test_lenient_comparisons():
    assert judge(call("get_weather", city="  PARIS ", unit="celsius")).reward == 1.0  # case and white space
    event = call("create_event", title="standup", start="2025-04-07T09:30:00", duration_minutes=15,
                 attendees=["ben@example.com", "ana@example.com"])  # fmt: skip
    assert judge(event, T(EVENT)).reward == 1.0  # seconds spelled out, attendees in another order
    money = {"name": "convert_currency", "arguments": {"amount": 19.99, "from": "GBP", "to": "CHF"}}
    assert judge(call("convert_currency", amount=19.990000001, **{"from": "GBP", "to": "CHF"}), T(money)).reward == 1.0
    assert judge(call("convert_currency", amount=19.9, **{"from": "GBP", "to": "CHF"}), T(money)).reward == 0.0
    assert judge(call("convert_currency", amount=19.9, **{"from": "GBP", "to": "CHF"}), T(money, tolerance=0.01)).reward == 1.0


def test_arguments_as_a_json_string_are_accepted():
    text = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})})
    assert judge(text).reward == 1.0


@pytest.mark.parametrize("completion", ["It is sunny in Paris.", "```json\n{not json}\n```", '{"city": "Paris"}', ""])
def test_no_call_found(completion):
    v = judge(completion)
    assert (v.reward, v.verdict) == (0.0, "fail") and "no tool call found" in v.feedback.message


def test_bad_task_is_an_error_through_score_batch():
    # No sandbox is needed for tool calls: score_batch never touches it.
    ok, bad = score_batch(
        None,
        [
            (T(), call("get_weather", city="Paris", unit="celsius")),  # type: ignore[arg-type]
            (T({"name": "teleport", "arguments": {}}), call("get_weather", city="Paris")),
        ],
    )
    assert (ok.reward, ok.verdict) == (1.0, "pass")
    assert bad.verdict == "error" and bad.feedback.message.startswith("bad task")
