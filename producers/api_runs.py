"""What the producer API knows of the broker's runs, kept between requests.

A request must not cost the broker a connection: on Kafka each ``list_topics`` opens an admin
client, and each consumer group the coordinator's bookkeeping. So :class:`RunDirectory` lists
topics at most once per ``refresh_s`` however many requests ask, and :class:`ProgressReaders`
keeps one group-less reader per recently asked run, reading only what is new on each request.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from conveyor.contracts import DecodeError, LearnerProgress, decode
from conveyor.topics import Topics
from conveyor.transport.base import Consumer, Transport

log = structlog.get_logger(__name__)


class RunDirectory:
    """Whether a run's topics exist. A run seen is trusted for ``ttl_s`` (so a deleted run is
    noticed); a run not seen costs at most one listing per ``refresh_s``, shared by every request
    that waits on it."""

    def __init__(
        self, transport: Transport, *, ttl_s: float = 60.0, refresh_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._transport = transport
        self._ttl, self._refresh, self._clock = ttl_s, refresh_s, clock
        self._seen: dict[str, float] = {}
        self._topics: frozenset[str] = frozenset()
        self._listed_at = -float("inf")
        self._lock = asyncio.Lock()
        self.listings = 0

    def add(self, run_id: str) -> None:
        self._seen[run_id] = self._clock()

    async def exists(self, run_id: str) -> bool:
        seen = self._seen.get(run_id)
        if seen is not None and self._clock() - seen < self._ttl:
            return True
        async with self._lock:
            if self._clock() - self._listed_at >= self._refresh:
                self._topics = frozenset(await self._transport.list_topics())
                self._listed_at = self._clock()
                self.listings += 1
        if Topics(run_id).tasks in self._topics:
            self.add(run_id)
            return True
        self._seen.pop(run_id, None)
        return False


@dataclass
class _Reader:
    consumer: Consumer
    latest: LearnerProgress | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ProgressReaders:
    """The learner's latest progress per run, from one reader (no consumer group) per run, kept for
    the ``max_runs`` runs asked about most recently. A record that is not a LearnerProgress (a
    foreign writer, a newer schema) is skipped and logged: the status of a run is still served."""

    def __init__(self, transport: Transport, *, max_runs: int = 16) -> None:
        self._transport = transport
        self._max_runs = max_runs
        self._readers: OrderedDict[str, _Reader] = OrderedDict()
        self._lock = asyncio.Lock()

    async def latest(self, run_id: str) -> LearnerProgress | None:
        reader = await self._reader(run_id)
        async with reader.lock:
            try:
                for _ in range(10):
                    records = await reader.consumer.getmany(timeout_s=0.2, max_records=10_000)
                    for rec in records:
                        try:
                            progress = decode(rec.value, LearnerProgress)
                        except DecodeError as exc:
                            log.warning("api.progress_undecodable", run_id=run_id, offset=rec.offset, error=str(exc)[:200])
                            continue
                        if progress.run_id == run_id:
                            reader.latest = progress
                    if not records or await reader.consumer.caught_up():
                        break
            except Exception:
                await self._drop(run_id, reader)  # the next request starts a fresh reader
                raise
            return reader.latest

    async def _reader(self, run_id: str) -> _Reader:
        async with self._lock:
            reader = self._readers.get(run_id)
            if reader is not None:
                self._readers.move_to_end(run_id)
                return reader
            consumer = self._transport.consumer([Topics(run_id).progress], None)
            await consumer.start()
            reader = self._readers[run_id] = _Reader(consumer)
            evicted = self._readers.popitem(last=False) if len(self._readers) > self._max_runs else None
        if evicted is not None:
            async with evicted[1].lock:
                await evicted[1].consumer.close()
        return reader

    async def _drop(self, run_id: str, reader: _Reader) -> None:
        if self._readers.get(run_id) is reader:
            del self._readers[run_id]
        await reader.consumer.close()

    async def close(self) -> None:
        readers, self._readers = list(self._readers.values()), OrderedDict()
        for reader in readers:
            await reader.consumer.close()
