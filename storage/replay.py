"""Replay from the trajectory lake: to a topic, to files, or into the learner.

- :func:`replay_to_topic` re-publishes a run's rollouts (optionally filtered)
  as ``ScoredRollout`` messages at a bounded rate, waiting for the broker's
  acknowledgements.
- :func:`export` writes them as JSONL (one ``to_builtins`` object per line)
  or as one Parquet file with the lake's schema.
- :class:`ReplaySource` has the subscriber's interface (``poll``,
  ``commit``, ``commit_offsets``, ``close``), so the learner trains from the
  lake through the same code path as from the scored topic; offsets are
  positions in the replay's deterministic order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from conveyor.contracts import ScoredRollout, to_builtins
from conveyor.messaging import Delivery, Publisher
from conveyor.transport.base import Record, TopicPartition, Transport
from storage.lake import SCHEMA, LakeFilter, LakeReader, rows_from_table, table_from_rows


async def replay_to_topic(
    reader: LakeReader, flt: LakeFilter, transport: Transport, topic: str, *, rate_per_s: float | None = None, on_rows=None
) -> int:
    """Publish every matching rollout to ``topic`` (key: task id); returns how many. ``on_rows(n)``
    as they go (the CLI's progress)."""
    producer = transport.producer()
    await producer.start()
    pub: Publisher[ScoredRollout] = Publisher(producer, topic)
    sent, start = 0, time.monotonic()
    pending = []
    try:
        for s in reader.iter(flt):
            if rate_per_s:
                ahead = start + sent / rate_per_s - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
            pending.append(await pub.publish(s, s.rollout.task_id))
            sent += 1
            if len(pending) >= 512:
                await asyncio.gather(*pending)
                if on_rows is not None:
                    on_rows(len(pending))
                pending = []
        await asyncio.gather(*pending)
        if on_rows is not None:
            on_rows(len(pending))
    finally:
        await producer.close()
    return sent


def export(reader: LakeReader, flt: LakeFilter, fmt: str, out: Path, on_rows=None) -> int:
    """Write matching rollouts to ``out`` as ``jsonl`` or ``parquet``; returns how many.
    ``on_rows(n)`` as they go (the CLI's progress)."""
    on_rows = on_rows or (lambda _n: None)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    if fmt == "jsonl":
        with out.open("w") as fh:
            for s in reader.iter(flt):
                fh.write(json.dumps(to_builtins(s), separators=(",", ":")) + "\n")
                n += 1
                if n % 1024 == 0:
                    on_rows(1024)
        on_rows(n % 1024)
        return n
    if fmt == "parquet":
        # Arrow tables straight from the parts (no Python object per row); a part written in an
        # earlier layout is brought to the current schema through the row codec.
        with pq.ParquetWriter(str(out), SCHEMA, compression="zstd") as writer:
            for table in reader.iter_tables(flt):
                if not table.schema.equals(SCHEMA):
                    table = table_from_rows(rows_from_table(table))
                writer.write_table(table)
                n += table.num_rows
                on_rows(table.num_rows)
        return n
    raise ValueError(f"unknown export format {fmt!r}: jsonl or parquet")


class ReplaySource:
    """The lake as a subscriber: ``poll`` yields deliveries in the replay's order."""

    def __init__(self, reader: LakeReader, flt: LakeFilter | None = None, *, start: int = 0) -> None:
        self._lease = contextlib.ExitStack()  # vacuum keeps the version replayed until close()
        self._lease.enter_context(reader.leased())
        self.topic = f"replay:{reader.run_id}"
        self._rows: Iterator[ScoredRollout] = itertools.islice(reader.iter(flt), start, None)
        self._next = start
        self.committed = start
        self.exhausted = False

    async def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Delivery[ScoredRollout]]:
        chunk = await asyncio.to_thread(lambda: list(itertools.islice(self._rows, max_records or 1024)))
        if not chunk:
            self.exhausted = True
            await asyncio.sleep(min(timeout_s, 0.05))
            return []
        out = []
        for s in chunk:
            rec = Record(self.topic, 0, self._next, s.rollout.task_id.encode(), b"", int(s.scored_at * 1000))
            out.append(Delivery(s, rec))
            self._next += 1
        return out

    async def commit(self, deliveries=None) -> None:
        if deliveries:
            self.committed = max(self.committed, max(d.record.offset for d in deliveries) + 1)
        else:
            self.committed = self._next

    async def commit_offsets(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, off in offsets.items():
            if tp.topic == self.topic:
                self.committed = max(self.committed, off)

    async def close(self) -> None:
        self._lease.close()
