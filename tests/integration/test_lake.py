"""The trajectory lake against a local directory and the real SeaweedFS S3: the rollouts table
(commits with offsets, conflicts, time travel, compaction, vacuum, foreign readers), filters,
deterministic replay, export, the learner's replay source, and the older part layout (read
deduplicated, migrated into the table)."""

from __future__ import annotations

import asyncio
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake.transaction import AddAction
from unit.test_lake_codec import scored

from storage.lake import SCHEMA, LakeFilter, LakeReader, parquet_bytes, part_key, rows_from_table, table_from_rows
from storage.lake_parts import migrate_parts, write_parts
from storage.table import ConcurrentCommit, RolloutTable, app_id

# `store` (local directory and SeaweedFS) comes from conftest.py.


def rows(lo, hi, version=3, **kw):
    return [scored(i, version=version, **kw) for i in range(lo, hi)]


def both_ways(reader: LakeReader, flt: LakeFilter | None = None) -> list[str]:
    """The rollout ids ``iter`` yields, checked equal (same order) to ``iter_tables``'s rows."""
    ids = [s.rollout_id for s in reader.iter(flt)]
    assert [rid for t in reader.iter_tables(flt) for rid in t["rollout_id"].to_pylist()] == ids
    return ids


def append(store, run_id, batch, offsets=None) -> int:
    return RolloutTable(store, run_id).append(batch, offsets)


def foreign_count(store, run_id) -> tuple[int, int]:
    """(rows, distinct rollout ids) as Polars reads the table itself (delta-rs log, its own Parquet reader)."""
    import polars as pl

    uri, options = store.table_location(f"runs/{run_id}/rollouts")
    ids = pl.read_delta(uri, storage_options=options or None, columns=["rollout_id"])["rollout_id"]
    return len(ids), ids.n_unique()


def test_commits_carry_offsets_and_a_stale_writer_of_the_same_partition_is_refused(store):
    a, b = RolloutTable(store, "r"), RolloutTable(store, "r")
    a.append(rows(0, 8), {app_id("scored", 0): 8})
    b.ensure()  # b's snapshot: offset 8
    a.append(rows(8, 12), {app_id("scored", 0): 12})
    with pytest.raises(ConcurrentCommit):
        b.append(rows(8, 12), {app_id("scored", 0): 12})  # the same records again, from a stale snapshot
    b.append(rows(12, 14), {app_id("scored", 1): 2})  # another partition: a blind append, retried and committed
    assert RolloutTable(store, "r").committed_offsets([app_id("scored", 0), app_id("scored", 1), app_id("scored", 2)]) == {
        app_id("scored", 0): 12, app_id("scored", 1): 2}  # fmt: skip
    got = both_ways(LakeReader(store, "r"))
    assert len(got) == len(set(got)) == 14
    assert foreign_count(store, "r") == (14, 14)


def test_the_part_layout_reads_each_rollout_once_and_migrates_into_the_table(store):
    write_parts(store, "r", rows(0, 8))
    write_parts(store, "r", rows(4, 12))  # a crashed sink's redelivery, grouped differently
    before = both_ways(LakeReader(store, "r"))
    assert len(before) == len(set(before)) == 12 and LakeReader(store, "r").version is None
    assert migrate_parts(store, "r") == 12
    assert migrate_parts(store, "r") == 0  # a table with rows is left alone
    reader = LakeReader(store, "r")
    assert reader.version is not None and sorted(both_ways(reader)) == sorted(before)
    assert foreign_count(store, "r") == (12, 12)


def test_time_travel_compaction_and_a_vacuum_that_keeps_leased_versions(store):
    table = RolloutTable(store, "r")
    for lo in range(0, 40, 8):
        table.append(rows(lo, lo + 8, version=4 - lo // 8))
    v2 = LakeReader(store, "r", version=2)
    assert v2.version == 2 and len(list(v2.iter())) == 16
    lease = table.lease(2, ttl_s=600)
    table.compact()
    reader = LakeReader(store, "r")
    assert len(reader.files()) == 1 and len(both_ways(reader)) == 40
    assert [f.policy_version_min for f in reader.files()] == [0]
    table.vacuum(retention_hours=0)  # version 2's files survive: leased
    assert len(list(LakeReader(store, "r", version=2).iter())) == 16
    store.delete(lease)
    removed = table.vacuum(retention_hours=0)
    assert len(removed) >= 5 and len(both_ways(LakeReader(store, "r"))) == 40
    assert foreign_count(store, "r") == (40, 40)


def test_a_run_without_a_table_refuses_time_travel(store):
    with pytest.raises(ValueError, match="no rollouts table"):
        list(LakeReader(store, "nothing", version=0).iter())


def test_filters(store):
    append(store, "r", rows(0, 8, version=1))
    append(store, "r", rows(8, 16, version=2))
    reader = LakeReader(store, "r")
    assert {s.rollout.min_policy_version for s in reader.iter(LakeFilter(policy_version_min=2))} == {2}
    assert all(s.reward >= 0.5 for s in reader.iter(LakeFilter(reward_min=0.5)))
    assert len(list(reader.iter(LakeFilter(reward_min=0.5)))) == 11
    assert list(reader.iter(LakeFilter(verdicts=frozenset({"pass"})))) == []
    all_rows = list(reader.iter())
    cut = sorted(s.scored_at for s in all_rows)[5]
    assert all(s.scored_at <= cut for s in reader.iter(LakeFilter(scored_before=cut)))
    assert reader.stats()["rows"] == 16 and reader.stats()["policy_versions"] == [1, 2]
    for flt in (LakeFilter(policy_version_min=2), LakeFilter(policy_version_max=1, reward_min=0.5), LakeFilter(reward_max=0.5),
                LakeFilter(verdicts=frozenset({"pass"})), LakeFilter(scored_before=cut), LakeFilter(scored_after=cut)):  # fmt: skip
        both_ways(reader, flt)


def test_replay_is_deterministic(store):
    for lo in range(0, 40, 8):
        append(store, "r", rows(lo, lo + 8, version=lo // 16))
    flt = LakeFilter(reward_min=0.3)
    a = both_ways(LakeReader(store, "r", prefetch=1), flt)
    b = both_ways(LakeReader(store, "r", prefetch=4), flt)
    assert a == b and len(a) == 37


def test_export_jsonl_and_parquet(store, tmp_path):
    from storage.replay import export

    append(store, "r", rows(0, 10))
    reader = LakeReader(store, "r")
    assert export(reader, LakeFilter(), "jsonl", tmp_path / "out.jsonl") == 10
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert lines[0]["t"] == "scored" and len(lines[0]["rollout"]["completion_token_ids"]) == 50
    assert export(reader, LakeFilter(reward_min=0.5), "parquet", tmp_path / "out.parquet") == 5
    exported = pq.read_table(tmp_path / "out.parquet")
    assert exported.schema.equals(SCHEMA) and rows_from_table(exported) == list(reader.iter(LakeFilter(reward_min=0.5)))
    # A part in an earlier layout (loss mask as a uint8 list) is exported in the current schema.
    write_parts(store, "old", rows(0, 10))
    reader = LakeReader(store, "old")
    old_rows = sorted(rows(20, 24, version=5), key=lambda r: r.rollout_id)  # as write_parts lays a part out
    table = pq.read_table(io.BytesIO(parquet_bytes(old_rows)))
    i = table.schema.get_field_index("loss_mask")
    masks = pa.array([list(bytes(r.rollout.loss_mask)) for r in old_rows], pa.list_(pa.uint8()))
    buf = io.BytesIO()
    pq.write_table(table.set_column(i, pa.field("loss_mask", pa.list_(pa.uint8())), masks), buf)
    store.put_if_absent(part_key("old", 5, [r.rollout_id for r in old_rows]), buf.getvalue())
    assert export(reader, LakeFilter(), "parquet", tmp_path / "all.parquet") == 14
    exported = pq.read_table(tmp_path / "all.parquet")
    assert exported.schema.equals(SCHEMA) and rows_from_table(exported) == list(reader.iter())
    assert rows_from_table(exported)[-4:] == old_rows
    assert export(reader, LakeFilter(verdicts=frozenset({"pass"})), "parquet", tmp_path / "none.parquet") == 0
    assert pq.read_table(tmp_path / "none.parquet").schema.equals(SCHEMA)


def test_replay_source_has_the_subscriber_interface(store):
    from storage.replay import ReplaySource

    append(store, "r", rows(0, 10))

    async def drain():
        src = ReplaySource(LakeReader(store, "r"))
        assert len(list(store.list("runs/r/rollouts_leases/"))) == 1  # vacuum keeps the version replayed...
        got = []
        while not src.exhausted:
            batch = await src.poll(timeout_s=0.1, max_records=3)
            got += batch
            await src.commit(batch)
        await src.close()
        assert not list(store.list("runs/r/rollouts_leases/"))  # ...until the replay is closed
        return src, got

    src, got = asyncio.run(drain())
    assert [d.record.offset for d in got] == list(range(10)) and src.committed == 10
    assert [d.message.rollout_id for d in got] == [s.rollout_id for s in LakeReader(store, "r").iter()]


def test_file_statistics_prune_what_a_filter_excludes(tmp_path):
    from conveyor.objectstore import LocalObjectStore

    class Counting(LocalObjectStore):
        gets: list[str] = []

        def get(self, key, **kw):
            self.gets.append(key)
            return super().get(key, **kw)

    store = Counting(tmp_path / "objects")
    low = [scored(i) for i in range(0, 8)]  # rewards 0.0 .. 0.7
    high = [scored(i, version=4) for i in range(10, 18)]  # rewards 1.0 .. 1.7, another part
    append(store, "r", low)
    append(store, "r", high)
    reader = LakeReader(store, "r")
    store.gets.clear()
    assert len(list(reader.iter())) == 16 and len(store.gets) == 2
    store.gets.clear()
    assert [s.rollout_id for s in reader.iter(LakeFilter(reward_min=1.0))] == sorted(s.rollout_id for s in high)
    assert store.gets == [reader.files(LakeFilter(policy_version_min=4))[0].key]  # the low file skipped by its statistics
    store.gets.clear()
    assert list(reader.iter(LakeFilter(policy_version_min=5))) == [] and store.gets == []


def test_a_column_added_to_the_schema_is_added_to_an_older_table(store):
    """A table created before a column existed gains it at the next writer's start; its older files
    read with nulls there, through Conveyor's reader and a foreign one."""
    from deltalake import DeltaTable

    older = pa.schema([f for f in SCHEMA if f.name != "split"])
    uri, options = store.table_location("runs/r/rollouts")
    DeltaTable.create(uri, older, storage_options=options or None)
    table = RolloutTable(store, "r")
    path = "part-older.parquet"
    data = table_from_rows(rows(0, 4)).drop_columns(["split"])
    buf = io.BytesIO()
    pq.write_table(data, buf)
    store.put(table.prefix + path, buf.getvalue())
    DeltaTable(uri, storage_options=options or None).create_write_transaction(
        [AddAction(path, len(buf.getvalue()), {}, 0, True, '{"numRecords": 4}')], "append", older
    )
    append(store, "r", rows(4, 8))
    assert "split" in [f.name for f in RolloutTable(store, "r").open().schema().fields]
    reader = LakeReader(store, "r")
    splits = [v for t in reader.iter_tables() for v in t["split"].to_pylist()]
    assert sorted(splits, key=str) == sorted([None] * 4 + ["train"] * 4, key=str)
    assert len(list(reader.iter())) == 8 and foreign_count(store, "r") == (8, 8)
