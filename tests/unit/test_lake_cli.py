"""``conveyor runs migrate|compact|vacuum`` and ``conveyor replay --table-version``: the rollouts
table's maintenance from the command line, on a local object store."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner
from unit.test_lake_codec import scored

from conveyor.objectstore import LocalObjectStore
from launch.cli.main import app
from storage.lake import LakeReader
from storage.lake_parts import write_parts
from storage.table import RolloutTable

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _logging_left_alone(monkeypatch):
    """CliRunner closes the stderr the CLI's callback would point logging at."""
    import conveyor.logging

    monkeypatch.setattr(conveyor.logging, "configure_logging", lambda *a, **kw: None)


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_migrate_copies_the_part_layout_once_and_only_then_deletes_it(tmp_path):
    store = LocalObjectStore(tmp_path)
    write_parts(store, "old", [scored(i) for i in range(6)])
    write_parts(store, "old", [scored(i) for i in range(3, 9)])  # a redelivered flush, in another part
    res = cli("runs", "migrate", "old", "--store", tmp_path)
    assert res.exit_code == 0 and "copied 9 rollouts" in res.output, res.output
    res = cli("runs", "migrate", "old", "--store", tmp_path, "--delete-parts")
    assert res.exit_code == 0 and "deleted" in res.output, res.output
    assert not list(store.list("runs/old/lake/"))
    assert sorted(s.rollout_id for s in LakeReader(store, "old").iter()) == sorted(scored(i).rollout_id for i in range(9))
    assert cli("runs", "migrate", "old", "--store", tmp_path).exit_code == 2  # nothing left to migrate


def test_a_table_with_its_own_rows_is_not_migrated_into(tmp_path):
    store = LocalObjectStore(tmp_path)
    RolloutTable(store, "r").append([scored(i) for i in range(3)])
    write_parts(store, "r", [scored(i) for i in range(5)])
    res = cli("runs", "migrate", "r", "--store", tmp_path)
    assert res.exit_code == 2 and "twice" in res.output, res.output


def test_compact_then_vacuum_and_replay_an_older_version(tmp_path):
    store = LocalObjectStore(tmp_path)
    table = RolloutTable(store, "r")
    for lo in range(0, 20, 5):
        table.append([scored(i) for i in range(lo, lo + 5)])
    res = cli("runs", "compact", "r", "--store", tmp_path)
    assert res.exit_code == 0 and json.loads(res.output)["numFilesRemoved"] == 4, res.output
    res = cli("runs", "vacuum", "r", "--store", tmp_path, "--retention-hours", "0", "--dry-run")
    assert res.exit_code == 0 and "would delete 4 files" in res.output, res.output
    res = cli("replay", "r", "--store", tmp_path, "--table-version", "2", "--export", "jsonl", "--out", tmp_path / "v2.jsonl")
    assert res.exit_code == 0 and "exported 10 rollouts" in res.output, res.output
    assert not list(store.list("runs/r/rollouts_leases/"))  # the export's lease is gone with it
    res = cli("runs", "vacuum", "r", "--store", tmp_path, "--retention-hours", "0")
    assert res.exit_code == 0 and "deleted 4 files" in res.output, res.output
    assert len(list(LakeReader(store, "r").iter())) == 20
    assert cli("runs", "compact", "nothing", "--store", tmp_path).exit_code == 2
