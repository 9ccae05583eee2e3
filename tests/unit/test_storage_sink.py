"""The storage sink's flush pipeline, in memory: several flushes in flight,
offsets committed in order, and no more than ``max_inflight`` writes at once.
(Outage and SIGKILL against the real broker and S3: tests/chaos/test_lake_sink.py.)"""

from __future__ import annotations

import asyncio
import threading

import pytest
from unit.test_lake_codec import scored

from conveyor.config import SinkConfig
from conveyor.messaging import Publisher
from conveyor.metrics import SinkMetrics, make_registry
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport import TopicPartition
from conveyor.transport.memory import MemoryTransport
from storage.lake import LakeReader
from storage.sink import StorageSink
from storage.table import RolloutTable, app_id


class GatedStore(LocalObjectStore):
    """Parts wait at their gate (by write order) until the test opens it."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.gates: dict[int, threading.Event] = {}
        self.started = 0
        self.finished = 0
        self.in_flight_max = 0
        self._lock = threading.Lock()
        self._in_flight = 0

    def put_if_absent(self, key: str, data: bytes, *, sha256: str | None = None) -> bool:
        with self._lock:
            n = self.started
            self.started += 1
            self._in_flight += 1
            self.in_flight_max = max(self.in_flight_max, self._in_flight)
        gate = self.gates.get(n)
        if gate is not None:
            assert gate.wait(10), f"part {n} was never released"
        try:
            return super().put_if_absent(key, data, sha256=sha256)
        finally:
            with self._lock:
                self._in_flight -= 1
                self.finished += 1


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_later_flushes_finish_first_but_offsets_commit_in_order(tmp_path):
    transport = MemoryTransport(partitions=1)
    topics = Topics("r")
    await transport.create_topics(topics.specs(1))
    rows = [scored(i, version=0) for i in range(40)]
    producer = transport.producer()
    pub = Publisher(producer, topics.scored)

    async def publish(batch):
        await asyncio.gather(*[await pub.publish(r, "k") for r in batch])

    store = GatedStore(tmp_path)
    first = store.gates[0] = threading.Event()
    registry = make_registry()
    sink = StorageSink(transport, topics, store, SinkConfig(flush_rows=10, flush_s=60.0, max_inflight=2),
                       metrics=SinkMetrics.create(registry))  # fmt: skip
    stop = asyncio.Event()
    run = asyncio.create_task(sink.run(stop))
    tp = TopicPartition(topics.scored, 0)

    await publish(rows[:10])
    await wait_for(lambda: store.started == 1)  # the first flush is held at its gate
    await publish(rows[10:20])
    await wait_for(lambda: store.finished == 1)  # the second one lands before it
    await asyncio.sleep(0.5)  # a few idle polls: its offsets must still wait for the first
    assert transport.broker.groups[topics.group("storage-sink")].committed.get(tp) is None
    await publish(rows[20:])
    await asyncio.sleep(0.3)
    # Nothing may be committed past the held flush (to the table or to Kafka), and no third write
    # starts while two are out.
    assert transport.broker.groups[topics.group("storage-sink")].committed.get(tp) is None
    assert RolloutTable(store, "r").committed_offsets([app_id(topics.scored, 0)]) == {}
    assert store.started == 2 and store.in_flight_max == 2

    first.set()
    stop.set()
    await asyncio.wait_for(run, 30)
    assert transport.broker.groups[topics.group("storage-sink")].committed[tp] == 40
    assert store.in_flight_max == 2
    assert sorted(s.rollout_id for s in LakeReader(store, "r").iter()) == sorted(r.rollout_id for r in rows)
    assert RolloutTable(store, "r").committed_offsets([app_id(topics.scored, 0)]) == {app_id(topics.scored, 0): 40}
    files = LakeReader(store, "r").files()
    assert registry.get_sample_value("conveyor_lake_rows_total") == 40
    assert registry.get_sample_value("conveyor_lake_parts_total") == len(files) >= 3
    assert registry.get_sample_value("conveyor_lake_bytes_total") == sum(f.size for f in files)
    assert registry.get_sample_value("conveyor_lake_flush_seconds_count") >= 3


def test_max_inflight_below_one_is_refused():
    with pytest.raises(ValueError, match="max_inflight"):
        SinkConfig(max_inflight=0)


async def run_sink(transport, topics, store, **cfg) -> StorageSink:
    """A sink that reads what is published, stores it and stops."""
    sink = StorageSink(transport, topics, store, SinkConfig(flush_rows=10, flush_s=0.05, **cfg))
    stop = asyncio.Event()
    stop.set()  # drain what is there, then return
    await asyncio.wait_for(sink.run(stop), 30)
    return sink


async def published(rows, partitions: int = 2) -> tuple[MemoryTransport, Topics]:
    transport = MemoryTransport(partitions=partitions)
    topics = Topics("r")
    await transport.create_topics(topics.specs(partitions))
    pub = Publisher(transport.producer(), topics.scored)
    await asyncio.gather(*[await pub.publish(r, r.rollout.task_id) for r in rows])
    return transport, topics


async def test_a_table_ahead_of_kafka_is_where_a_restarted_sink_starts(tmp_path):
    """A sink that died after its table commit and before Kafka's: the next one seeks by the table."""
    rows = [scored(i) for i in range(30)]
    transport, topics = await published(rows)
    store = LocalObjectStore(tmp_path)
    await run_sink(transport, topics, store)
    transport.broker.groups[topics.group("storage-sink")].committed.clear()  # Kafka forgot; the table did not
    again = await run_sink(transport, topics, store)
    assert again.rows_written == 0
    ids = [s.rollout_id for s in LakeReader(store, "r").iter()]
    assert sorted(ids) == sorted(r.rollout_id for r in rows)


async def test_a_rollout_published_twice_is_stored_once(tmp_path):
    rows = [scored(i) for i in range(12)]
    transport, topics = await published(rows + rows[3:5], partitions=1)  # a reward bridge's redelivery
    store = LocalObjectStore(tmp_path)
    sink = await run_sink(transport, topics, store)
    ids = [s.rollout_id for s in LakeReader(store, "r").iter()]
    assert sorted(ids) == sorted(r.rollout_id for r in rows) and sink.duplicates_dropped == 2


async def test_a_partition_another_writer_advanced_is_not_stored_twice(tmp_path):
    """The other owner of a rebalanced partition commits its first records while this sink's flush is
    out: this sink's commit is refused, and it stores only the records past the other's."""
    rows = [scored(i) for i in range(10)]
    transport, topics = await published(rows, partitions=1)
    store = GatedStore(tmp_path)
    gate = store.gates[0] = threading.Event()
    RolloutTable(store, "r").ensure()
    sink = StorageSink(transport, topics, store, SinkConfig(flush_rows=10, flush_s=0.05))
    stop = asyncio.Event()
    run = asyncio.create_task(sink.run(stop))
    await wait_for(lambda: store.started == 1)
    other = RolloutTable(store, "r")
    await asyncio.to_thread(other.append, rows[:4], {app_id(topics.scored, 0): 4})
    gate.set()
    stop.set()
    await asyncio.wait_for(run, 30)
    ids = [s.rollout_id for s in LakeReader(store, "r").iter()]
    assert sorted(ids) == sorted(r.rollout_id for r in rows)
    assert sink.commits_refused == 1 and sink.already_stored == 4 and sink.rows_written == 6


async def test_a_run_in_the_part_layout_is_migrated_when_the_sink_starts(tmp_path):
    from storage.lake_parts import write_parts

    store = LocalObjectStore(tmp_path)
    old = [scored(i) for i in range(100, 108)]
    write_parts(store, "r", old)
    rows = [scored(i) for i in range(8)]
    transport, topics = await published(rows)
    await run_sink(transport, topics, store)
    ids = [s.rollout_id for s in LakeReader(store, "r").iter()]
    assert sorted(ids) == sorted(r.rollout_id for r in old + rows)


async def test_records_read_again_after_a_reassignment_are_not_committed_twice(tmp_path):
    """A partition re-assigned to the same sink is sought to the table's offset, behind its flushes still
    in flight: those records come again in a later flush, which stores only what is past them and never
    moves the table's offset back."""
    from conveyor.messaging import Delivery
    from conveyor.transport.base import Record

    store = LocalObjectStore(tmp_path)
    sink = StorageSink(MemoryTransport(), Topics("r"), store, SinkConfig(dedupe_window=0))
    await sink._prepare()
    rows = [scored(i) for i in range(10)]
    deliveries = [Delivery(r, Record("conveyor.r.scored", 0, i, b"k", b"", 0)) for i, r in enumerate(rows)]
    await sink._commit(None, deliveries[:6], sink.table.write_file(rows[:6]), deliveries[:6])
    await sink._commit(None, deliveries[3:], sink.table.write_file(rows[3:]), deliveries[3:])  # 3..5 read twice
    assert sorted(s.rollout_id for s in LakeReader(store, "r").iter()) == sorted(r.rollout_id for r in rows)
    assert sink.already_stored == 3 and sink.rows_written == 10
    await sink._commit(None, deliveries[:2], sink.table.write_file(rows[:2]), deliveries[:2])  # nothing new: no commit
    assert RolloutTable(store, "r").committed_offsets([app_id("conveyor.r.scored", 0)]) == {app_id("conveyor.r.scored", 0): 10}
    assert len(list(LakeReader(store, "r").iter())) == 10
