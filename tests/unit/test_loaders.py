"""Task loaders: presets, field mappings, and precise reports of bad records."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conveyor.contracts import ChatMessage, Task, decode, encode
from conveyor.errors import ConfigError
from producers.loaders import (
    FieldMapping,
    RecordError,
    RecordRejected,
    TaskFileError,
    iter_tasks,
    load_mapping,
    load_tasks,
    resolve_mapping,
)

RUN = "run-1"


def write_jsonl(path: Path, lines: list) -> Path:
    """Dicts are written as JSON, strings as they are (to write broken lines)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def where(errors: list[RecordError]) -> list[tuple]:
    return [(e.line, e.row, e.field) for e in errors]


def math_record(task_id: str, prompt, answer="4", **extra) -> dict:
    return {"task_id": task_id, "prompt": prompt, "verifier": {"kind": "math", "data": {"answer": answer}}, **extra}


# --------------------------------------------------------------------------
# plain (Conveyor's own layout)


def test_plain_jsonl_good_records(tmp_path):
    path = write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            math_record("a", "What is 2+2?", group_size=4, split="test", priority=3, metadata={"level": 1, "src": "x"}),
            {
                "task_id": "b",
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                "verifier": {"kind": "math", "data": {"answer": 4}},
                "sampling": {"temperature": 0.7, "max_tokens": 64},
            },
            {
                "task_id": "c",
                "prompt": "def f(): ...",
                "verifier": {"kind": "python_tests", "data": {"tests": "assert f() is None"}},
            },
        ],
    )
    result = load_tasks(path, RUN, "plain")
    assert result.ok and result.records == 3
    a, b, c = result.tasks
    assert (a.task_id, a.run_id, a.prompt, a.messages) == ("a", RUN, "What is 2+2?", None)
    assert a.verifier.kind == "math" and a.verifier.data == {"answer": "4"}
    assert (a.group_size, a.split, a.priority) == (4, "heldout", 3)
    assert a.metadata == {"level": "1", "src": "x", "source": "tasks.jsonl:1"}
    # Chat messages stay messages: the worker renders them with the model's template.
    assert b.prompt is None
    assert b.messages == [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="2+2?")]
    assert b.sampling is not None and b.sampling.temperature == 0.7 and b.sampling.max_tokens == 64
    assert (b.group_size, b.split) == (1, "train")
    assert c.verifier.kind == "python_tests"
    for task in result.tasks:  # every task survives the wire
        assert decode(encode(task), Task) == task


def test_plain_is_the_default_mapping(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [math_record("a", "1+3?")])
    assert load_tasks(path, RUN).tasks[0].task_id == "a"


BAD_LINES = [
    math_record("ok-1", "1+1?"),  # 1
    '{"task_id": "broken", "prompt": ',  # 2: bad JSON
    {"task_id": "no-prompt", "verifier": {"kind": "math", "data": {"answer": "1"}}},  # 3
    math_record("bad-size", "1+1?", group_size="eight"),  # 4
    math_record("empty", "   "),  # 5
    {"task_id": "nope", "prompt": "x", "verifier": {"kind": "vibes", "data": {}}},  # 6
    "",  # 7: blank lines are not records
    {
        "task_id": "role",
        "messages": [{"role": "wizard", "content": "hi"}],
        "verifier": {"kind": "math", "data": {"answer": "1"}},
    },  # 8
    math_record("ok-1", "again?"),  # 9: duplicate id
    "[1, 2, 3]",  # 10: not an object
    math_record("no-answer", "1+1?", answer=None),  # 11
    math_record("ok-2", "2+2?"),  # 12
    {"task_id": "size0", "prompt": "x", "group_size": 0, "verifier": {"kind": "math", "data": {"answer": "1"}}},  # 13
    {"task_id": "split", "prompt": "x", "split": "someday", "verifier": {"kind": "math", "data": {"answer": "1"}}},  # 14
    {"task_id": "verif", "prompt": "x", "verifier": "math"},  # 15
    {
        "task_id": "content",
        "messages": [{"role": "user", "content": 5}],
        "verifier": {"kind": "math", "data": {"answer": "1"}},
    },  # 16
]


def test_bad_jsonl_records_are_reported_precisely_and_skipped(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    result = load_tasks(path, RUN, "plain", on_error="skip")
    assert [t.task_id for t in result.tasks] == ["ok-1", "ok-2"]
    assert where(result.errors) == [
        (2, None, None),
        (3, None, "prompt or messages"),
        (4, None, "group_size"),
        (5, None, "prompt"),
        (6, None, "verifier.kind"),
        (8, None, "messages[0].role"),
        (9, None, "task_id"),
        (10, None, None),
        (11, None, "verifier.data.answer"),
        (13, None, "group_size"),
        (14, None, "split"),
        (15, None, "verifier"),
        (16, None, "messages[0].content"),
    ]
    assert result.records == 15  # the blank line is not a record
    by_line = {e.line: e for e in result.errors}
    assert "invalid JSON" in by_line[2].reason
    assert "expected an integer, got text" in by_line[4].reason
    assert "empty prompt" in by_line[5].reason
    assert "unknown verifier kind 'vibes'" in by_line[6].reason
    assert "first at bad.jsonl:1" in by_line[9].reason
    assert "expected an object, got list" in by_line[10].reason
    assert "at least 1" in by_line[13].reason
    assert all(e.file == str(path) for e in result.errors)
    assert str(by_line[4]).startswith(f"{path}:4: group_size: ")


def test_fail_mode_raises_at_the_first_bad_record(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    with pytest.raises(RecordRejected) as info:
        load_tasks(path, RUN, "plain", on_error="fail")
    assert info.value.error == RecordError(str(path), 2, None, None, info.value.error.reason)
    assert f"{path}:2:" in str(info.value)
    path = write_jsonl(tmp_path / "bad4.jsonl", [math_record("a", "1+1?"), math_record("b", "x", group_size=-2)])
    with pytest.raises(RecordRejected, match=r"bad4\.jsonl:2: group_size: must be at least 1"):
        load_tasks(path, RUN)


def test_on_error_must_be_skip_or_fail(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [math_record("a", "1+3?")])
    with pytest.raises(ValueError, match="on_error"):
        load_tasks(path, RUN, "plain", on_error="ignore")  # type: ignore[arg-type]


def test_unreadable_lines_and_gzip(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    body = json.dumps(math_record("a", "1+1?")).encode() + b"\n" + b'{"prompt": "\xff\xfe"}\n'
    path.write_bytes(gzip.compress(body))
    result = load_tasks(path, RUN, "plain", on_error="skip")
    assert [t.task_id for t in result.tasks] == ["a"]
    assert where(result.errors) == [(2, None, None)] and "not UTF-8" in result.errors[0].reason


def test_missing_file_is_a_file_error(tmp_path):
    with pytest.raises(TaskFileError, match="no such file"):
        load_tasks(tmp_path / "nope.jsonl", RUN)


def test_corrupt_parquet_is_a_file_error(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1" + b"\0" * 64)
    with pytest.raises(TaskFileError, match="Parquet"):
        load_tasks(path, RUN, "verl")


# --------------------------------------------------------------------------
# hashed ids, overrides, limits


def test_hashed_ids_are_stable_and_duplicates_rejected(tmp_path):
    rec = {"question": "2+2?", "answer": "4"}
    mapping = {"prompt": "question", "verifier": {"kind": "math", "data": {"answer": "answer"}}}
    a = write_jsonl(tmp_path / "a.jsonl", [rec])
    b = write_jsonl(tmp_path / "b.jsonl", [{"answer": "4", "question": "2+2?"}, {"question": "3+3?", "answer": "6"}, rec])
    ta = load_tasks(a, RUN, mapping).tasks
    res = load_tasks(b, RUN, mapping, on_error="skip")
    assert ta[0].task_id == res.tasks[0].task_id  # same content, any key order, any file
    assert ta[0].task_id.startswith("t-")
    assert res.tasks[0].task_id != res.tasks[1].task_id
    assert where(res.errors) == [(3, None, "<record>")]
    assert "duplicate task id" in res.errors[0].reason


def test_group_size_override_and_task_size_limit(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [math_record("a", "1+1?", group_size=2), math_record("b", "x" * 5000)])
    assert [t.group_size for t in load_tasks(path, RUN, on_error="skip", group_size=8).tasks] == [8, 8]
    res = load_tasks(path, RUN, on_error="skip", max_task_bytes=2000)
    assert [t.task_id for t in res.tasks] == ["a"]
    assert where(res.errors) == [(2, None, None)] and "over the limit of 2000" in res.errors[0].reason


def test_iterator_form_streams_and_collects_errors(tmp_path):
    lines = [math_record(f"t{i}", f"{i}+1?") if i % 10 else "not json" for i in range(1, 101)]
    loader = iter_tasks(write_jsonl(tmp_path / "big.jsonl", lines), RUN, "plain", on_error="skip")
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    assert [t.task_id for t in first] == ["t1", "t2", "t3", "t4", "t5"] and loader.errors == []
    rest = list(it)
    assert len(first) + len(rest) == 90 == loader.tasks
    assert [e.line for e in loader.errors] == list(range(10, 101, 10))
    assert loader.records == 100


# --------------------------------------------------------------------------
# verl (Parquet)

VERL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
    ]
)


def verl_row(i: int, question: str | None, truth: str | None, split: str = "train") -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [] if question is None else [{"content": question, "role": "user"}],
        "ability": "math",
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": {"index": i, "split": split},
    }


def test_verl_parquet(tmp_path):
    rows = [
        verl_row(0, "Natalia sold 48 clips... How many?", "72"),
        verl_row(1, "Weng earns $12 an hour... How much?", None),  # no ground truth
        verl_row(2, None, "5"),  # empty prompt
        verl_row(3, "A robe takes 2 bolts... How many?", "3", split="test"),
    ]
    path = write_parquet(tmp_path / "train.parquet", rows, VERL_SCHEMA)
    res = load_tasks(path, RUN, "verl", on_error="skip")
    assert where(res.errors) == [(None, 1, "reward_model.ground_truth"), (None, 2, "prompt")]
    assert str(res.errors[0]) == f"{path}:row 1: reward_model.ground_truth: missing"
    a, d = res.tasks
    assert a.prompt is None and a.messages == [ChatMessage(role="user", content="Natalia sold 48 clips... How many?")]
    assert a.verifier.kind == "math" and a.verifier.data == {"answer": "72"}
    assert a.metadata["data_source"] == "openai/gsm8k" and a.metadata["extra_info.index"] == "0"
    assert a.metadata["source"] == "train.parquet:row 0"
    assert (a.split, d.split) == ("train", "heldout")
    assert a.task_id != d.task_id
    with pytest.raises(RecordRejected, match=r"train\.parquet:row 1: reward_model\.ground_truth: missing"):
        load_tasks(path, RUN, "verl", on_error="fail")


def test_verl_mapping_override(tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": "2+2?"}],
            "reward_model": {"style": "rule"},
            "extra_info": {"answer": "4", "index": 7},
        }
    ]
    path = write_parquet(tmp_path / "t.parquet", rows)
    assert load_tasks(path, RUN, "verl", on_error="skip").errors[0].field == "reward_model.ground_truth"
    mapping_file = tmp_path / "m.yaml"
    mapping_file.write_text("preset: verl\nverifier:\n  kind: math\n  data: {answer: extra_info.answer}\ndefault_group_size: 4\n")
    task = load_tasks(path, RUN, load_mapping(mapping_file)).tasks[0]
    assert task.verifier.data == {"answer": "4"} and task.group_size == 4


def test_verl_wrong_types(tmp_path):
    rows = [
        {"prompt": "plain text prompts are fine", "reward_model": {"ground_truth": [1, 2]}},
        {"prompt": 42, "reward_model": {"ground_truth": "1"}},
        {"prompt": [{"role": "user", "content": "x"}], "reward_model": "1"},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    res = load_tasks(path, RUN, "verl", on_error="skip")
    assert where(res.errors) == [(1, None, "reward_model.ground_truth"), (2, None, "prompt"), (3, None, "reward_model")]
    assert "expected text or a number, got list" in res.errors[0].reason
    assert "expected an object, got text" in res.errors[2].reason


# --------------------------------------------------------------------------
# trl


def test_trl_records(tmp_path):
    lines = [
        {"prompt": "What is 6*7?", "solution": "42"},
        {
            "prompt": [{"role": "user", "content": "Write add(a, b)."}],
            "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
        },
        {"id": "p3", "prompt": "Write sub(a, b).", "test": "assert sub(3, 1) == 2"},
        {"prompt": "No ground truth here"},
        {"prompt": "", "solution": "1"},
    ]
    path = write_jsonl(tmp_path / "trl.jsonl", lines)
    res = load_tasks(path, RUN, "trl", on_error="skip")
    math_task, add_task, sub_task = res.tasks
    assert math_task.prompt == "What is 6*7?" and math_task.verifier.kind == "math"
    assert math_task.verifier.data == {"answer": "42"}
    assert add_task.messages == [ChatMessage(role="user", content="Write add(a, b).")] and add_task.prompt is None
    assert add_task.verifier.kind == "python_tests"
    assert add_task.verifier.data["tests"] == "assert add(1, 2) == 3\nassert add(0, 0) == 0"
    assert sub_task.task_id == "p3" and sub_task.verifier.data == {"tests": "assert sub(3, 1) == 2"}
    assert where(res.errors) == [(4, None, "solution|tests|test"), (5, None, "prompt")]
    assert "no verifier layout matches" in res.errors[0].reason


def test_trl_parquet(tmp_path):
    path = write_parquet(tmp_path / "trl.parquet", [{"prompt": "1+1?", "solution": "2"}, {"prompt": "2+2?", "solution": None}])
    res = load_tasks(path, RUN, "trl", on_error="skip")
    assert [t.verifier.data for t in res.tasks] == [{"answer": "2"}]
    assert where(res.errors) == [(None, 1, "solution|tests|test")]


# --------------------------------------------------------------------------
# custom mappings


def test_custom_mapping(tmp_path):
    mapping = FieldMapping(
        prompt="question",
        task_id="uid",
        verifier={"kind": "math", "data": {"answer": "final"}, "constants": {"tolerance": 0.01}},
        group_size="n",
        metadata=["source", "meta.level"],
        record_source=False,
    )
    lines = [
        {"uid": 17, "question": "Pi to 2 places?", "final": 3.14, "n": 8, "source": "mine", "meta": {"level": 2}},
        {"uid": "x", "question": "?", "final": "1", "n": 2.5},
        {"uid": True, "question": "?", "final": "1"},
    ]
    res = load_tasks(write_jsonl(tmp_path / "t.jsonl", lines), RUN, mapping, on_error="skip")
    (task,) = res.tasks
    assert task.task_id == "17" and task.group_size == 8
    assert task.verifier.data == {"answer": 3.14, "tolerance": 0.01}
    assert task.metadata == {"source": "mine", "meta.level": "2"}
    assert where(res.errors) == [(2, None, "n"), (3, None, "uid")]


def test_mapping_from_dict_and_yaml(tmp_path):
    m = resolve_mapping({"prompt": "q", "verifier": [{"kind": "math", "data": {"answer": "a"}}]})
    assert m.prompt == "q" and m.task_id == "task_id"  # other fields from plain
    assert resolve_mapping("trl") is resolve_mapping(preset="trl")
    yaml_file = tmp_path / "m.yaml"
    yaml_file.write_text("prompt: q\nverifier: {kind: math, data: {answer: a}}\n")
    assert load_mapping(yaml_file, preset="trl").verifier[0].data == {"answer": "a"}


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"preset": "nope"}, "unknown preset 'nope'"),
        ({"promt": "q"}, "promt"),
        ({"verifier": {"kind": "vibes"}}, "unknown verifier kind"),
        ({"verifier": {"kind": "math", "kind_field": "k"}}, "exactly one of kind"),
        ({"verifier": []}, "at least one verifier rule"),
    ],
)
def test_bad_mappings_are_config_errors(mapping, message):
    with pytest.raises(ConfigError, match=message):
        resolve_mapping(mapping)


def test_mapping_yaml_errors(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level"):
        load_mapping(f)
    f.write_text("preset: verl\n")
    with pytest.raises(ConfigError, match="names preset 'verl'"):
        load_mapping(f, preset="trl")


def test_a_loader_is_iterated_once(tmp_path):
    loader = iter_tasks(write_jsonl(tmp_path / "t.jsonl", [math_record("a", "1+3?")]), RUN)
    assert len(list(loader)) == 1
    with pytest.raises(RuntimeError, match="iterated once"):
        iter(loader)
