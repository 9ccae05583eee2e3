"""A run config's ``data:`` section: a user's dataset file becomes the producer's task stream, with
the run's group size and sampling filling in what the records lack, epochs as new attempts, and
a file that cannot be trained refused at start with the field named."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conveyor.config import parse_run_config
from conveyor.contracts import ChatMessage, rollout_id
from conveyor.errors import ConfigError
from producers.build import task_source
from producers.datasets import epochs, load_dataset
from tests.cli import invoke


def verl_rows(n: int) -> list[dict]:
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(n)
    ]
    rows[-1]["extra_info"]["split"] = "test"  # one held-out row
    return rows


def write_verl(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def cfg_for(**data):
    return parse_run_config({"run_id": "d1", "producer": {"group_size": 4}, "data": data})


def test_a_verl_file_becomes_trainable_chat_tasks(tmp_path):
    path = write_verl(tmp_path / "gsm8k.parquet", verl_rows(6))
    cfg = cfg_for(files=[str(path)], preset="verl")
    cfg = cfg.model_copy(
        update={"sampling": cfg.sampling.model_copy(update={"max_tokens": 300, "temperature": 0.8, "stop": ["\n\n"]})}
    )
    ds = load_dataset(cfg)
    assert (len(ds.tasks), ds.records, len(ds.held_out)) == (5, 6, 1)
    assert ds.held_out[0].split == "heldout" and ds.held_out[0].sampling.max_tokens == 300
    task = ds.tasks[0]
    assert task.messages == [ChatMessage(role="user", content="What is 0 + 0?")]
    assert task.group_size == 4  # the run's, where the record carries none
    assert (task.sampling.max_tokens, task.sampling.temperature, task.sampling.stop) == (300, 0.8, ["\n\n"])
    assert task.verifier.kind == "math" and task.verifier.data == {"answer": "0"}


def test_a_tasks_own_group_size_and_sampling_win(tmp_path):
    path = tmp_path / "t.jsonl"
    record = {"task_id": "a", "prompt": "2+2=", "verifier": {"kind": "math", "data": {"answer": "4"}}}
    path.write_text(json.dumps({**record, "group_size": 6, "sampling": {"max_tokens": 9}}) + "\n")
    task = load_dataset(cfg_for(files=[str(path)])).tasks[0]
    assert task.group_size == 6 and task.sampling.max_tokens == 9


def test_epochs_are_new_attempts_in_a_new_order(tmp_path):
    path = write_verl(tmp_path / "gsm8k.parquet", verl_rows(9))
    cfg = cfg_for(files=[str(path)], preset="verl", epochs=3, shuffle_seed=5)
    tasks = list(epochs(cfg, load_dataset(cfg)))
    assert len(tasks) == 24
    passes = [tasks[i * 8 : (i + 1) * 8] for i in range(3)]
    assert [{t.attempt for t in p} for p in passes] == [{0}, {1}, {2}]
    assert all(sorted(t.task_id for t in p) == sorted(t.task_id for t in passes[0]) for p in passes)
    assert [t.task_id for t in passes[0]] != [t.task_id for t in passes[1]]  # reshuffled
    ids = {rollout_id(t.task_id, i, t.attempt) for t in tasks for i in range(t.group_size)}
    assert len(ids) == 24 * 4  # every pass's rollouts are new ones
    assert [t.task_id for t in epochs(cfg, load_dataset(cfg))] == [t.task_id for t in tasks]  # deterministic


def test_the_producer_streams_the_data_instead_of_the_suite(tmp_path):
    path = write_verl(tmp_path / "gsm8k.parquet", verl_rows(4))
    cfg = parse_run_config(
        {
            "run_id": "d1",
            "producer": {"suite": "pyexpr", "max_tasks": 5},
            "data": {"files": [str(path)], "preset": "verl", "epochs": 4},
        }
    )
    tasks = list(task_source(cfg).tasks)
    assert len(tasks) == 5 and all(t.verifier.data["answer"] in {"0", "2", "4"} for t in tasks)


def test_a_bad_record_refuses_the_start_naming_it(tmp_path):
    rows = verl_rows(3)
    rows[1]["reward_model"]["ground_truth"] = None
    path = write_verl(tmp_path / "gsm8k.parquet", rows)
    with pytest.raises(ConfigError, match=r"gsm8k\.parquet:row 1: reward_model\.ground_truth: missing"):
        load_dataset(cfg_for(files=[str(path)], preset="verl"))
    skipped = load_dataset(cfg_for(files=[str(path)], preset="verl", on_error="skip"))
    assert len(skipped.tasks) == 1 and len(skipped.rejected) == 1


def test_what_cannot_be_trained_is_refused_with_the_field_named(tmp_path):
    with pytest.raises(ConfigError, match="producer.group_size: .*must be >= 2"):
        parse_run_config({"producer": {"group_size": 1}})
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"task_id": "a", "prompt": "p", "verifier": {"kind": "math", "data": {"answer": "1"}}, "group_size": 1})
    )
    with pytest.raises(ConfigError, match="task 'a' .* group_size 1"):
        load_dataset(cfg_for(files=[str(path)]))
    with pytest.raises(ConfigError, match="data.files: .*no such file"):
        load_dataset(cfg_for(files=[str(tmp_path / "absent.jsonl")]))
    with pytest.raises(ConfigError, match="data.mapping"):
        load_dataset(cfg_for(files=[str(path)], mapping={"prompt": None, "messages": None}))
    heldout_only = write_verl(tmp_path / "h.parquet", verl_rows(1))
    with pytest.raises(ConfigError, match="no train tasks"):
        load_dataset(cfg_for(files=[str(heldout_only)], preset="verl"))


def test_config_validate_checks_the_data_files(monkeypatch, tmp_path):

    good = write_verl(tmp_path / "gsm8k.parquet", verl_rows(5))
    rows = verl_rows(3)
    rows[2]["prompt"] = []
    bad = write_verl(tmp_path / "bad.parquet", rows)
    for path, code, says in [(good, 0, "data: 4 train tasks from 5 records"), (bad, 2, "bad.parquet:row 2: prompt")]:
        cfg = tmp_path / "run.yaml"
        cfg.write_text(json.dumps({"run_id": "v", "data": {"files": [str(path)], "preset": "verl"}}))
        out = invoke(monkeypatch, ["config", "validate", str(cfg)])
        assert out.exit_code == code and says in out.output, out.output


def test_the_evaluator_takes_the_other_splits_tasks_and_refuses_files_without_any(tmp_path):
    import typer

    from launch.cli.serve import _heldout_tasks

    path = write_verl(tmp_path / "gsm8k.parquet", verl_rows(6))
    cfg = parse_run_config({"run_id": "e", "data": {"files": [str(path)], "preset": "verl"}, "eval": {"every": 2}})
    held = _heldout_tasks(cfg)
    assert [t.split for t in held] == ["heldout"] and held[0].messages[0].content == "What is 5 + 5?"
    rows = verl_rows(3)
    rows[-1]["extra_info"]["split"] = "train"
    only_train = write_verl(tmp_path / "train.parquet", rows)
    with pytest.raises(typer.Exit) as refused:
        _heldout_tasks(parse_run_config({"run_id": "e", "data": {"files": [str(only_train)], "preset": "verl"}}))
    assert refused.value.exit_code == 2
