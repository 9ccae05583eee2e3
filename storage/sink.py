"""Storage sink: scored topic -> Parquet parts in the trajectory lake.

Its own consumer group on the scored topic. Rows are buffered and flushed
by count or age (``storage/lake.py`` writes one part per oldest policy
version, named by its contents, put-if-absent, then its manifest entry).
Offsets are committed only after the object store confirmed every write of
the flush. Up to ``max_inflight`` flushes (default 2) are written in
background threads while the next batch is read: encoding one part overlaps
the S3 server storing the previous one (1.2-1.5x the rate of one at a time,
docs/BENCHMARKS.md); their commits stay in order. While the object store is down the sink retries the same flush
with exponential backoff and does not poll (so it holds its position and
its memory stays bounded); when the store is back the flush lands and the
offsets are committed. A crash at any point re-reads the uncommitted rows;
rewriting them is idempotent at the object level, and the reader returns
each rollout once. A rebalance is the same: a flush whose partitions moved
before its commit is stored but not committed (``commits_refused``), and the
new owner re-reads and rewrites its rows. Not polling while the store is down
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
from conveyor.transport.base import CommitFailed, Transport
from storage.lake import table_from_rows, write_parts

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
        self.flush_rows = cfg.flush_rows
        self.flush_s = cfg.flush_s
        self.group_id = group_id or topics.group("storage-sink")
        self.backoff_max_s = cfg.backoff_max_s
        self.give_up_after_s = cfg.give_up_after_s
        self.max_inflight = cfg.max_inflight
        self.rows_written = 0
        self.rows_dead_lettered = 0
        self.retries = 0
        self.commits_refused = 0  # flushes whose partitions a rebalance moved before their commit
        self.first_record_at: float | None = None  # monotonic: first record polled (throughput figures)
        self.last_flush_at: float | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Consume, flush, commit; up to ``max_inflight`` flushes run while the next batch is read.

        Commits stay in order: a batch's offsets are committed only after its own
        write and every earlier one completed."""
        async with ServiceClients(
            self.transport, self.topics.dead_letter, "storage-sink", heartbeats=self.topics, claim_check=self.claim_check
        ) as io:
            sub = await io.subscribe([self.topics.scored], self.group_id, ScoredRollout)
            buffer: list = []
            inflight: deque[tuple[asyncio.Task, list]] = deque()  # oldest first
            oldest = time.monotonic()
            quiet = 0  # consecutive empty polls

            async def settle_oldest() -> None:
                task, deliveries = inflight[0]
                await task  # raises if the store stayed down past give_up_after_s: nothing committed
                inflight.popleft()
                # Only partitions still held: the rows of one a rebalance moved are stored, and its new
                # owner re-reads and rewrites them (the lake reader returns each rollout once).
                assigned = sub.assignment()
                mine = [d for d in deliveries if d.record.tp in assigned]
                error = ""
                try:
                    if mine:
                        await sub.commit(mine)
                except CommitFailed as exc:  # moved between the check and the commit
                    mine, error = [], str(exc)[:200]
                if len(mine) < len(deliveries):
                    self.commits_refused += 1
                    log.warning("storage_sink.commit_after_rebalance", rows=len(deliveries) - len(mine), error=error)

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

    async def _flush_until_stored(self, sub: Subscriber[ScoredRollout], deliveries: list[Delivery[ScoredRollout]]) -> None:
        # A store span per traced task of the flush: its trace ends when its rows are in the lake.
        spans = [start_child("store", h, **{"conveyor.task_id": ds[0].message.rollout.task_id, "conveyor.rows": len(ds)})
                 for h, ds in by_trace((d, d.record.headers) for d in deliveries).values()]  # fmt: skip
        try:
            await self._write(sub, deliveries)
        finally:
            for span in spans:
                span.end()

    async def _write(self, sub: Subscriber[ScoredRollout], deliveries: list[Delivery[ScoredRollout]]) -> None:
        delay, started = 0.25, time.monotonic()
        rows = [d.message for d in deliveries]
        while True:
            try:
                parts = await asyncio.to_thread(write_parts, self.store, self.topics.run_id, rows)
                break
            except RetryableError as exc:  # the object store is unreachable: hold position, retry
                self.retries += 1
                if time.monotonic() - started > self.give_up_after_s:
                    raise
                log.warning("lake_write_retry", rows=len(rows), retry_in_s=round(delay, 2), error=str(exc)[:200])
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.backoff_max_s)
            except Exception:
                # Not the store: a row the lake cannot hold. Find the rows that fail on their own,
                # dead-letter them and store the rest; a failure no single row explains is raised.
                rows = await self._without_unstorable(sub, deliveries)
                if len(rows) == len(deliveries):
                    raise
                if not rows:
                    return
        if os.environ.get("CONVEYOR_FAILPOINT") == "sink_after_write":  # chaos tests: die between write and commit
            os.kill(os.getpid(), signal.SIGKILL)
        self.last_flush_at = time.monotonic()
        self.rows_written += sum(p.rows for p in parts)
        if self.metrics:
            self.metrics.rows.inc(sum(p.rows for p in parts))
            self.metrics.bytes.inc(sum(p.size for p in parts))
            self.metrics.parts.inc(len(parts))
            self.metrics.flush_seconds.observe(self.last_flush_at - started)
        log.info("lake_flush", rows=sum(p.rows for p in parts), parts=len(parts))

    async def _without_unstorable(
        self, sub: Subscriber[ScoredRollout], deliveries: list[Delivery[ScoredRollout]]
    ) -> list[ScoredRollout]:
        kept = []
        for d in deliveries:
            try:
                await asyncio.to_thread(table_from_rows, [d.message])
            except Exception as exc:  # noqa: BLE001 - whatever the row does to the writer, it is the row's
                self.rows_dead_lettered += 1
                await sub.dead_letter(d, "Unstorable", f"{type(exc).__name__}: {exc}")
            else:
                kept.append(d.message)
        return kept
