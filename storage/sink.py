"""Storage sink: scored topic -> the run's rollouts table (Delta Lake, ``storage/table.py``).

Its own consumer group on the scored topic. Rows are buffered and flushed by
count or age. Each flush is written as one Parquet data file, then committed
to the table in one atomic Delta commit that also records, per scored-topic
partition, the next offset to store (a Delta ``txn``). The table is the record
of what is stored: on assignment the sink seeks each partition to the offset
the table holds, and Kafka offsets are committed after the table commit only
as a convenience (and for lag). A sink killed at any point leaves every
rollout in the table once, for every reader: a data file written but not
committed is invisible (vacuum removes it), and a flush committed but not
acknowledged to Kafka is skipped on restart.

Up to ``max_inflight`` flushes (default 2) are encoded and written in
background threads while the next batch is read (1.2-1.5x the rate of one at
a time, docs/BENCHMARKS.md); their table commits stay in order. While the
object store is down the sink retries the same flush with exponential backoff
and does not poll (so it holds its position and its memory stays bounded).
A rebalance moves partitions mid-flush: the commit to the table still
happens, and whichever owner commits second finds the partition's offset
advanced (delta-rs refuses its commit as a concurrent transaction), drops the
rows already stored and commits the rest. Not polling while the store is down
is why ``transport.max_poll_interval_ms`` must outlast ``give_up_after_s``
(``conveyor/config_checks.py``): otherwise the broker drops the sink from its
group mid-outage and every flush is redone.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import deque

import structlog

from conveyor.config import SinkConfig
from conveyor.contracts import ScoredRollout
from conveyor.errors import RetryableError
from conveyor.messaging import DRAINED_AFTER_EMPTY_POLLS, ClaimCheck, Delivery, ServiceClients, Subscriber
from conveyor.metrics import SinkMetrics, process_sink_metrics
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.tracing import by_trace, start_child
from conveyor.transport.base import CommitFailed, TopicPartition, Transport, next_offsets
from storage.columns import table_from_rows
from storage.table import ConcurrentCommit, DataFile, RolloutTable, app_id

log = structlog.get_logger(__name__)


class StorageSink:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        store: ObjectStore,
        config: SinkConfig | None = None,
        *,
        group_id: str | None = None,
        claim_check: ClaimCheck | None = None,
        metrics: SinkMetrics | None = None,
    ) -> None:
        self.claim_check = claim_check  # messages over its threshold travel through the object store
        self.metrics = metrics if metrics is not None else process_sink_metrics()  # Prometheus, when served
        cfg = config or SinkConfig()
        self.transport = transport
        self.topics = topics
        self.store = store
        self.table = RolloutTable(store, topics.run_id)
        self.flush_rows = cfg.flush_rows
        self.flush_s = cfg.flush_s
        self.group_id = group_id or topics.group("storage-sink")
        self.backoff_max_s = cfg.backoff_max_s
        self.give_up_after_s = cfg.give_up_after_s
        self.max_inflight = cfg.max_inflight
        self.dedupe_window = cfg.dedupe_window
        self._recent: dict[str, None] = {}  # insertion-ordered: the oldest id is evicted first
        self.rows_written = 0
        self.rows_dead_lettered = 0
        self.duplicates_dropped = 0  # records of a rollout this sink stored already (see dedupe_window)
        self.already_stored = 0  # records another writer (or this sink before a restart) committed first
        self.retries = 0
        self.commits_refused = 0  # flushes whose table commit found a partition advanced by another writer
        self.first_record_at: float | None = None  # monotonic: first record polled (throughput figures)
        self.last_flush_at: float | None = None
        self._sub: Subscriber[ScoredRollout] | None = None
        # Next offset known stored per app id (this sink's commits, and the table's when it seeks): a
        # partition re-assigned to this sink mid-flush is sought behind flushes still in flight, and
        # the records read twice must not be committed twice, nor the table's offset moved back.
        self._stored: dict[str, int] = {}

    async def _retrying(self, what: str, fn, *args):
        """``fn(*args)`` in a thread, retried with backoff while storage is unreachable."""
        delay, started = 0.25, time.monotonic()
        while True:
            try:
                return await asyncio.to_thread(fn, *args)
            except RetryableError as exc:  # the object store is unreachable: hold position, retry
                self.retries += 1
                if time.monotonic() - started > self.give_up_after_s:
                    raise
                log.warning(f"lake_{what}_retry", retry_in_s=round(delay, 2), error=str(exc)[:200])
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.backoff_max_s)

    async def _seek_to_table(self, assigned: set[TopicPartition]) -> None:
        """Each newly assigned partition starts where the table says it was stored up to."""
        if self._sub is None or not assigned:
            return
        ids = {app_id(tp.topic, tp.partition): tp for tp in assigned}
        stored = await self._retrying("offsets", self.table.committed_offsets, list(ids))
        for a, offset in stored.items():
            self._sub.seek(ids[a], offset)
            self._stored[a] = max(self._stored.get(a, 0), offset)
        log.info("storage_sink.positions", from_table={f"{ids[a].partition}": o for a, o in sorted(stored.items())})

    async def _prepare(self) -> None:
        """Create the table; a run stored in the older part layout is copied into it first."""
        from storage.lake_parts import has_parts, migrate_parts

        if not await self._retrying("open", self.table.exists) and await asyncio.to_thread(
            has_parts, self.store, self.topics.run_id
        ):
            rows = await self._retrying("migrate", migrate_parts, self.store, self.topics.run_id)
            log.info("storage_sink.migrated_parts", rows=rows)
        await self._retrying("open", self.table.ensure)

    def _fresh(self, deliveries: list[Delivery[ScoredRollout]]) -> list[Delivery[ScoredRollout]]:
        """Deliveries of rollouts not stored recently by this sink (and not twice in this batch)."""
        if not self.dedupe_window:
            return deliveries
        out = []
        for d in deliveries:
            rid = d.message.rollout_id
            if rid in self._recent:
                self.duplicates_dropped += 1
                continue
            self._recent[rid] = None
            out.append(d)
        while len(self._recent) > self.dedupe_window:
            del self._recent[next(iter(self._recent))]
        return out

    async def run(self, stop: asyncio.Event) -> None:
        """Consume, write, commit to the table in order; up to ``max_inflight`` writes run while the
        next batch is read."""
        await self._prepare()
        async with ServiceClients(
            self.transport, self.topics.dead_letter, "storage-sink", heartbeats=self.topics, claim_check=self.claim_check
        ) as io:
            sub = await io.subscribe([self.topics.scored], self.group_id, ScoredRollout, on_assigned=self._seek_to_table)
            self._sub = sub  # partitions assigned before the callback could see `sub` are sought here
            await self._seek_to_table(set(sub.assignment()))
            buffer: list = []
            inflight: deque[tuple[asyncio.Task, list]] = deque()  # oldest first
            oldest = time.monotonic()
            quiet = 0  # consecutive empty polls

            async def settle_oldest() -> None:
                task, deliveries = inflight[0]
                written = await task  # raises if the store stayed down past give_up_after_s: nothing committed
                inflight.popleft()
                await self._commit(sub, deliveries, *written)
                # Kafka's offsets follow the table's (lag, and a start without the table's help); only for
                # partitions still held: a moved one's new owner seeks by the table anyway.
                assigned = sub.assignment()
                mine = [d for d in deliveries if d.record.tp in assigned]
                try:
                    if mine:
                        await sub.commit(mine)
                except CommitFailed as exc:  # moved between the check and the commit
                    log.info("storage_sink.kafka_commit_after_rebalance", rows=len(mine), error=str(exc)[:200])

            try:
                while True:
                    stopping = stop.is_set()
                    got = await sub.poll(timeout_s=0.2, max_records=1024)
                    quiet = 0 if got else quiet + 1
                    if got and self.first_record_at is None:
                        self.first_record_at = time.monotonic()
                    if got and not buffer:
                        oldest = time.monotonic()
                    buffer.extend(got)
                    due = len(buffer) >= self.flush_rows or (buffer and time.monotonic() - oldest >= self.flush_s)
                    if buffer and (due or (stopping and not got)):
                        while len(inflight) >= self.max_inflight:
                            await settle_oldest()
                        inflight.append((asyncio.create_task(self._flush_until_stored(sub, buffer)), buffer))
                        buffer = []
                    while inflight and inflight[0][0].done():
                        await settle_oldest()
                    while len(inflight) >= self.max_inflight and len(buffer) >= self.flush_rows:
                        await settle_oldest()  # bounded memory: max_inflight flushes and one batch buffered
                    if stopping and quiet >= DRAINED_AFTER_EMPTY_POLLS and not buffer:
                        while inflight:
                            await settle_oldest()
                        return
            finally:
                for task, _ in inflight:
                    if not task.done():
                        task.cancel()

    async def _flush_until_stored(
        self, sub: Subscriber[ScoredRollout], deliveries: list[Delivery[ScoredRollout]]
    ) -> tuple[DataFile | None, list[Delivery[ScoredRollout]]]:
        # A store span per traced task of the flush: its trace ends when its rows are written.
        spans = [start_child("store", h, **{"conveyor.task_id": ds[0].message.rollout.task_id, "conveyor.rows": len(ds)})
                 for h, ds in by_trace((d, d.record.headers) for d in deliveries).values()]  # fmt: skip
        try:
            return await self._write(sub, self._fresh(deliveries))
        finally:
            for span in spans:
                span.end()

    async def _write(
        self, sub: Subscriber[ScoredRollout], deliveries: list[Delivery[ScoredRollout]]
    ) -> tuple[DataFile | None, list[Delivery[ScoredRollout]]]:
        """The flush's data file (None: nothing to store) and the deliveries whose rows it holds."""
        started = time.monotonic()
        while deliveries:
            try:
                data = await self._retrying("write", self.table.write_file, [d.message for d in deliveries])
                break
            except RetryableError:
                raise
            except Exception:
                # Not the store: a row the lake cannot hold. Find the rows that fail on their own,
                # dead-letter them and store the rest; a failure no single row explains is raised.
                kept = await self._without_unstorable(sub, deliveries)
                if len(kept) == len(deliveries):
                    raise
                deliveries = kept
        else:
            return None, []
        if self.metrics:
            self.metrics.flush_seconds.observe(time.monotonic() - started)
        return data, deliveries

    async def _commit(self, sub, deliveries: list[Delivery[ScoredRollout]], data: DataFile | None,
                      stored: list[Delivery[ScoredRollout]]) -> None:  # fmt: skip
        """One table commit: the flush's file and, per partition, the next offset after the flush."""
        offsets = {app_id(tp.topic, tp.partition): o for tp, o in next_offsets([d.record for d in deliveries]).items()}
        files = [data] if data is not None else []
        if os.environ.get("CONVEYOR_FAILPOINT") == "sink_before_table_commit":  # chaos tests: a file nobody commits
            os.kill(os.getpid(), signal.SIGKILL)
        done = self._stored
        while True:
            before = len(stored)
            stored = [d for d in stored if d.record.offset >= done.get(app_id(d.record.tp.topic, d.record.tp.partition), 0)]
            offsets = {a: o for a, o in offsets.items() if o > done.get(a, 0)}
            if len(stored) < before:  # read twice (a re-assignment), or stored by another writer meanwhile
                self.already_stored += before - len(stored)
                log.warning("storage_sink.already_stored", records=before - len(stored), left=len(stored))
                files = [await self._retrying("write", self.table.write_file, [d.message for d in stored])] if stored else []
            if not offsets:
                return
            try:
                await self._retrying("commit", self.table.commit, files, offsets)
                break
            except ConcurrentCommit:
                # Another writer stored some of these partitions meanwhile (a rebalance's other owner,
                # or this sink's predecessor): keep only the records past what the table now holds.
                self.commits_refused += 1
                done = await self._retrying("offsets", self.table.committed_offsets, list(offsets))
                for a, o in done.items():
                    self._stored[a] = max(self._stored.get(a, 0), o)
        for a, o in offsets.items():
            self._stored[a] = max(self._stored.get(a, 0), o)
        if os.environ.get("CONVEYOR_FAILPOINT") == "sink_before_kafka_commit":  # chaos tests: the table is ahead of Kafka
            os.kill(os.getpid(), signal.SIGKILL)
        self.last_flush_at = time.monotonic()
        rows = sum(f.rows for f in files)
        self.rows_written += rows
        if self.metrics:
            self.metrics.rows.inc(rows)
            self.metrics.bytes.inc(sum(f.size for f in files))
            self.metrics.parts.inc(len(files))
        log.info("lake_flush", rows=rows, files=len(files))

    async def _without_unstorable(
        self, sub: Subscriber[ScoredRollout], deliveries: list[Delivery[ScoredRollout]]
    ) -> list[Delivery[ScoredRollout]]:
        kept = []
        for d in deliveries:
            try:
                await asyncio.to_thread(table_from_rows, [d.message])
            except Exception as exc:  # noqa: BLE001 - whatever the row does to the writer, it is the row's
                self.rows_dead_lettered += 1
                await sub.dead_letter(d, "Unstorable", f"{type(exc).__name__}: {exc}")
            else:
                kept.append(d)
        return kept
