"""``conveyor tasks validate`` and ``submit``, in process, against the memory transport."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conveyor.config import load_run_config
from conveyor.contracts import Task, decode
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from launch.cli import tasks as tasks_cli
from producers.loaders import RecordRejected

runner = CliRunner()
RUN = "sub-1"


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def record(task_id: str, prompt="1+1?", **extra) -> dict:
    return {"task_id": task_id, "prompt": prompt, "verifier": {"kind": "math", "data": {"answer": "2"}}, **extra}


GOOD = [record("a"), record("b", group_size=4), record("c", split="test")]
BAD = [record("a"), '{"task_id": ', record("b", group_size="x"), record("c")]


@pytest.fixture
def run_config(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"run_id: {RUN}\ntransport:\n  type: memory\n  partitions: 3\n")
    return path


def topic_tasks(transport: MemoryTransport, run_id: str = RUN) -> list[tuple[bytes, Task]]:
    parts = transport.broker.topics[Topics(run_id).tasks]
    return [(r.key, decode(r.value, Task)) for p in parts for r in p]


# --------------------------------------------------------------------------
# validate


def test_validate_good_file(tmp_path):
    path = write_jsonl(tmp_path / "good.jsonl", GOOD)
    result = runner.invoke(tasks_cli.app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert f"{path}: 3 records, 3 tasks ok, 0 rejected" in result.output


def test_validate_names_every_bad_record(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD)
    result = runner.invoke(tasks_cli.app, ["validate", str(path), "--preset", "plain"])
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"{path}:2: <record>: invalid JSON")
    assert lines[1] == f"{path}:3: group_size: expected an integer, got text"
    assert lines[2] == f"{path}: 4 records, 2 tasks ok, 2 rejected"


def test_validate_parquet_with_preset_and_mapping(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4", "style": "rule"}},
                {"prompt": [{"role": "user", "content": "3+3?"}], "reward_model": {"ground_truth": None, "style": "rule"}},
            ]
        ),
        path,
    )
    result = runner.invoke(tasks_cli.app, ["validate", str(path), "--preset", "verl"])
    assert result.exit_code == 1
    assert f"{path}:row 1: reward_model.ground_truth: missing" in result.stdout
    assert "2 records, 1 tasks ok, 1 rejected" in result.stdout
    mapping = tmp_path / "m.yaml"
    mapping.write_text("prompt: question\nverifier: {kind: math, data: {answer: answer}}\n")
    other = write_jsonl(tmp_path / "q.jsonl", [{"question": "2+2?", "answer": "4"}])
    result = runner.invoke(tasks_cli.app, ["validate", str(other), "--mapping", str(mapping), "--run", "r2"])
    assert result.exit_code == 0, result.output


def test_validate_file_problems(tmp_path):
    result = runner.invoke(tasks_cli.app, ["validate", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2 and "no such file" in result.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = runner.invoke(tasks_cli.app, ["validate", str(empty)])
    assert result.exit_code == 1 and "no records" in result.output
    result = runner.invoke(tasks_cli.app, ["validate", str(empty), "--preset", "nope"])
    assert result.exit_code == 2 and "unknown preset" in result.output


# --------------------------------------------------------------------------
# submit


def test_submit_publishes_every_task(tmp_path, run_config):
    transport = MemoryTransport()
    path = write_jsonl(tmp_path / "good.jsonl", GOOD)
    report = tasks_cli.submit_file(path, None, run_config, transport=transport)
    assert (report.published, report.records, report.rejected) == (3, 3, [])
    assert report.topic == Topics(RUN).tasks
    # The run's topics exist with the config's partitions; every task is on the tasks topic, keyed by its id.
    assert set(Topics(RUN).all()) <= set(transport.broker.topics)
    assert len(transport.broker.topics[Topics(RUN).tasks]) == 3
    published = topic_tasks(transport)
    assert sorted(k for k, _ in published) == [b"a", b"b", b"c"]
    assert all(k == t.task_id.encode() and t.run_id == RUN for k, t in published)
    by_id = {t.task_id: t for _, t in published}
    assert by_id["b"].group_size == 4 and by_id["c"].split == "heldout"


def test_submit_run_and_group_size_overrides(tmp_path, run_config):
    transport = MemoryTransport()
    path = write_jsonl(tmp_path / "good.jsonl", GOOD)
    report = tasks_cli.submit_file(path, "other-run", load_run_config(run_config), "plain", None, "fail", 8, transport=transport)
    assert report.published == 3
    published = topic_tasks(transport, "other-run")
    assert {t.group_size for _, t in published} == {8} and {t.run_id for _, t in published} == {"other-run"}


def test_submit_fail_publishes_nothing(tmp_path, run_config):
    transport = MemoryTransport()
    path = write_jsonl(tmp_path / "bad.jsonl", BAD)
    with pytest.raises(RecordRejected, match=r"bad\.jsonl:2"):
        tasks_cli.submit_file(path, None, run_config, on_error="fail", transport=transport)
    assert Topics(RUN).tasks not in transport.broker.topics


def test_submit_skip_publishes_the_good_ones(tmp_path, run_config):
    transport = MemoryTransport()
    path = write_jsonl(tmp_path / "bad.jsonl", BAD)
    report = tasks_cli.submit_file(path, None, run_config, on_error="skip", transport=transport)
    assert report.published == 2 and report.records == 4
    assert [(e.line, e.field) for e in report.rejected] == [(2, None), (3, "group_size")]
    assert sorted(t.task_id for _, t in topic_tasks(transport)) == ["a", "c"]


def test_submit_command(tmp_path, run_config, monkeypatch):
    transport = MemoryTransport()
    monkeypatch.setattr(tasks_cli, "_transport_for", lambda cfg: transport)
    bad = write_jsonl(tmp_path / "bad.jsonl", BAD)
    result = runner.invoke(tasks_cli.app, ["submit", str(bad), "--config", str(run_config)])
    assert result.exit_code == 1
    assert "bad.jsonl:2" in result.output and "nothing published" in result.output
    result = runner.invoke(
        tasks_cli.app, ["submit", str(bad), "--config", str(run_config), "--on-error", "skip", "--group-size", "2"]
    )
    assert result.exit_code == 0, result.output
    assert f"rejected {bad}:3: group_size: expected an integer, got text" in result.stdout
    assert f"published 2 tasks to {Topics(RUN).tasks}; rejected 2 of 4 records" in result.stdout
    assert {t.group_size for _, t in topic_tasks(transport)} == {2}


def test_submit_command_refuses_an_in_process_transport(tmp_path, run_config):
    path = write_jsonl(tmp_path / "good.jsonl", GOOD)
    result = runner.invoke(tasks_cli.app, ["submit", str(path), "--config", str(run_config)])
    assert result.exit_code == 2
    assert "memory transport" in result.output


def test_submit_command_bad_arguments(tmp_path, run_config):
    path = write_jsonl(tmp_path / "good.jsonl", GOOD)
    result = runner.invoke(tasks_cli.app, ["submit", str(path), "--config", str(run_config), "--on-error", "maybe"])
    assert result.exit_code == 2
    result = runner.invoke(tasks_cli.app, ["submit", str(path), "--config", str(run_config), "--run", "bad run!"])
    assert result.exit_code == 2 and "run_id" in result.output
