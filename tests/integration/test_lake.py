"""The trajectory lake against a local directory and the real SeaweedFS S3:
idempotent parts, dedupe at read time, filters, deterministic replay, export,
and the learner's replay source."""

from __future__ import annotations

import asyncio
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
from unit.test_lake_codec import scored

from storage.lake import SCHEMA, LakeFilter, LakeReader, parquet_bytes, part_key, rows_from_table, write_parts

# `store` (local directory and SeaweedFS) comes from conftest.py.


def rows(lo, hi, version=3, **kw):
    return [scored(i, version=version, **kw) for i in range(lo, hi)]


def both_ways(reader: LakeReader, flt: LakeFilter | None = None) -> list[str]:
    """The rollout ids ``iter`` yields, checked equal (same order) to ``iter_tables``'s rows."""
    ids = [s.rollout_id for s in reader.iter(flt)]
    assert [rid for t in reader.iter_tables(flt) for rid in t["rollout_id"].to_pylist()] == ids
    return ids


def test_the_same_batch_twice_is_one_identical_object(store):
    batch = rows(0, 8)
    [first] = write_parts(store, "r", batch)
    data = store.get(first.key)
    [again] = write_parts(store, "r", list(reversed(batch)))
    assert again.key == first.key and store.get(first.key) == data
    parts = [i.key for i in store.list("runs/r/lake/policy_version=")]
    assert parts == [first.key]


def test_overlapping_parts_read_each_rollout_once(store):
    write_parts(store, "r", rows(0, 8))
    write_parts(store, "r", rows(4, 12))  # a crashed sink's redelivery, grouped differently
    got = both_ways(LakeReader(store, "r"))
    assert len(got) == len(set(got)) == 12


def test_filters(store):
    write_parts(store, "r", rows(0, 8, version=1) + rows(8, 16, version=2))
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
        write_parts(store, "r", rows(lo, lo + 8, version=lo // 16))
    flt = LakeFilter(reward_min=0.3)
    a = both_ways(LakeReader(store, "r", prefetch=1), flt)
    b = both_ways(LakeReader(store, "r", prefetch=4), flt)
    assert a == b and len(a) == 37


def test_export_jsonl_and_parquet(store, tmp_path):
    from storage.replay import export

    write_parts(store, "r", rows(0, 10))
    reader = LakeReader(store, "r")
    assert export(reader, LakeFilter(), "jsonl", tmp_path / "out.jsonl") == 10
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert lines[0]["t"] == "scored" and len(lines[0]["rollout"]["completion_token_ids"]) == 50
    assert export(reader, LakeFilter(reward_min=0.5), "parquet", tmp_path / "out.parquet") == 5
    exported = pq.read_table(tmp_path / "out.parquet")
    assert exported.schema.equals(SCHEMA) and rows_from_table(exported) == list(reader.iter(LakeFilter(reward_min=0.5)))
    # A part in an earlier layout (loss mask as a uint8 list) is exported in the current schema.
    old_rows = sorted(rows(20, 24, version=5), key=lambda r: r.rollout_id)  # as write_parts lays a part out
    table = pq.read_table(io.BytesIO(parquet_bytes(old_rows)))
    i = table.schema.get_field_index("loss_mask")
    masks = pa.array([list(bytes(r.rollout.loss_mask)) for r in old_rows], pa.list_(pa.uint8()))
    buf = io.BytesIO()
    pq.write_table(table.set_column(i, pa.field("loss_mask", pa.list_(pa.uint8())), masks), buf)
    store.put_if_absent(part_key("r", 5, [r.rollout_id for r in old_rows]), buf.getvalue())
    assert export(reader, LakeFilter(), "parquet", tmp_path / "all.parquet") == 14
    exported = pq.read_table(tmp_path / "all.parquet")
    assert exported.schema.equals(SCHEMA) and rows_from_table(exported) == list(reader.iter())
    assert rows_from_table(exported)[-4:] == old_rows
    assert export(reader, LakeFilter(verdicts=frozenset({"pass"})), "parquet", tmp_path / "none.parquet") == 0
    assert pq.read_table(tmp_path / "none.parquet").schema.equals(SCHEMA)


def test_replay_source_has_the_subscriber_interface(store):
    from storage.replay import ReplaySource

    write_parts(store, "r", rows(0, 10))

    async def drain():
        src = ReplaySource(LakeReader(store, "r"))
        got = []
        while not src.exhausted:
            batch = await src.poll(timeout_s=0.1, max_records=3)
            got += batch
            await src.commit(batch)
        return src, got

    src, got = asyncio.run(drain())
    assert [d.record.offset for d in got] == list(range(10)) and src.committed == 10
    assert [d.message.rollout_id for d in got] == [s.rollout_id for s in LakeReader(store, "r").iter()]


def test_manifest_prunes_parts_and_is_read_only_when_the_filter_needs_it(tmp_path):
    from conveyor.objectstore import LocalObjectStore

    class Counting(LocalObjectStore):
        gets: list[str] = []

        def get(self, key, **kw):
            self.gets.append(key)
            return super().get(key, **kw)

    store = Counting(tmp_path / "objects")
    low = [scored(i) for i in range(0, 8)]  # rewards 0.0 .. 0.7
    high = [scored(i, version=4) for i in range(10, 18)]  # rewards 1.0 .. 1.7, another part
    write_parts(store, "r", low + high)
    reader = LakeReader(store, "r")
    store.gets.clear()
    assert len(list(reader.iter())) == 16
    assert not any("_manifest" in k for k in store.gets)  # no filter on statistics: no manifest reads
    store.gets.clear()
    assert [s.rollout_id for s in reader.iter(LakeFilter(reward_min=1.0))] == sorted(s.rollout_id for s in high)
    parts_read = [k for k in store.gets if k.endswith(".parquet")]
    assert len(parts_read) == 1 and "policy_version=4" in parts_read[0]  # the low part was skipped by its statistics
