"""In-process transport with Kafka's semantics (embedded mode and unit tests).

Partitions, keyed partitioning, consumer groups with range assignment and
rebalancing on join/leave, committed offsets and redelivery of what was not
committed: the same contract suite runs against this and a real broker.
The log is kept in memory for the life of the process.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections.abc import Awaitable, Sequence

from conveyor.transport.base import (
    CommitFailed,
    RebalanceCallback,
    Record,
    SendResult,
    TopicPartition,
    TopicSpec,
)


class UnknownTopic(KeyError):
    pass


def partition_for(key: bytes | None, partitions: int, counter: int) -> int:
    if key is None:
        return counter % partitions
    return zlib.crc32(key) % partitions


class _Group:
    def __init__(self) -> None:
        self.members: list[MemoryConsumer] = []
        self.committed: dict[TopicPartition, int] = {}


class MemoryBroker:
    """Holds topics and group state; one per process (or per test)."""

    def __init__(self, default_partitions: int = 4) -> None:
        self.default_partitions = default_partitions
        self.topics: dict[str, list[list[Record]]] = {}
        self.groups: dict[str, _Group] = {}
        self._changed: asyncio.Condition | None = None
        self._rr = itertools.count()
        self._member_ids = itertools.count()

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def create_topic(self, name: str, partitions: int) -> None:
        if name not in self.topics:
            self.topics[name] = [[] for _ in range(partitions)]

    def partitions(self, topic: str) -> int:
        return len(self.topics[topic])

    async def append(self, topic: str, key: bytes | None, value: bytes, headers: tuple) -> SendResult:
        if topic not in self.topics:
            # Like a broker with auto-create on: first write creates the topic.
            self.create_topic(topic, self.default_partitions)
        parts = self.topics[topic]
        p = partition_for(key, len(parts), next(self._rr))
        offset = len(parts[p])
        parts[p].append(Record(topic, p, offset, key, value, int(time.time() * 1000), headers))
        async with self.changed:
            self.changed.notify_all()
        return SendResult(topic, p, offset)

    async def rebalance(self, group_id: str) -> None:
        group = self.groups[group_id]
        members = sorted(group.members, key=lambda m: m.member_id)
        new: dict[MemoryConsumer, set[TopicPartition]] = {m: set() for m in members}
        topics = sorted({t for m in members for t in m.topics})
        for topic in topics:
            if topic not in self.topics:
                self.create_topic(topic, self.default_partitions)
            subs = [m for m in members if topic in m.topics]
            for p in range(self.partitions(topic)):
                new[subs[p % len(subs)]].add(TopicPartition(topic, p))
        for m in members:
            await m._reassign(new[m])
        async with self.changed:
            self.changed.notify_all()


class MemoryProducer:
    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker
        self._closed = False

    async def start(self) -> None:
        pass

    async def send(self, topic: str, value: bytes, key: bytes | None = None, headers: Sequence = ()) -> Awaitable[SendResult]:
        if self._closed:
            raise RuntimeError("producer is closed")
        result = await self._broker.append(topic, key, value, tuple(headers))
        fut: asyncio.Future[SendResult] = asyncio.get_running_loop().create_future()
        fut.set_result(result)
        return fut

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None, headers: Sequence = ()) -> SendResult:
        return await (await self.send(topic, value, key, headers))

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        self._closed = True


class MemoryConsumer:
    def __init__(
        self,
        broker: MemoryBroker,
        topics: Sequence[str],
        group_id: str | None,
        from_beginning: bool,
        on_assigned: RebalanceCallback | None,
        on_revoked: RebalanceCallback | None,
    ) -> None:
        self._broker = broker
        self.topics = tuple(topics)
        self.group_id = group_id
        self.member_id = next(broker._member_ids)
        self._from_beginning = from_beginning
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._assigned: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._started = False

    def __hash__(self) -> int:
        return self.member_id

    async def start(self) -> None:
        self._started = True
        if self.group_id is None:  # a reader: every partition, no group, nothing committed
            for topic in self.topics:
                if topic not in self._broker.topics:
                    self._broker.create_topic(topic, self._broker.default_partitions)
            tps = {TopicPartition(t, p) for t in self.topics for p in range(self._broker.partitions(t))}
            for tp in tps:
                self._positions[tp] = 0 if self._from_beginning else len(self._broker.topics[tp.topic][tp.partition])
            self._assigned = tps
            if self._on_assigned:
                await self._on_assigned(set(tps))
            return
        group = self._broker.groups.setdefault(self.group_id, _Group())
        group.members.append(self)
        await self._broker.rebalance(self.group_id)

    async def _reassign(self, new: set[TopicPartition]) -> None:
        revoked = self._assigned - new
        added = new - self._assigned
        if revoked and self._on_revoked:
            await self._on_revoked(revoked)
        for tp in revoked:
            self._positions.pop(tp, None)
        assert self.group_id is not None  # only group members are reassigned
        group = self._broker.groups[self.group_id]
        for tp in added:
            committed = group.committed.get(tp)
            if committed is None:
                committed = 0 if self._from_beginning else len(self._broker.topics[tp.topic][tp.partition])
            self._positions[tp] = committed
        self._assigned = set(new)
        if added and self._on_assigned:
            await self._on_assigned(added)

    async def getmany(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Record]:
        if not self._started:
            raise RuntimeError("consumer not started")
        deadline = asyncio.get_running_loop().time() + timeout_s
        limit = max_records or 500
        while True:
            out: list[Record] = []
            for tp in sorted(self._assigned, key=lambda t: (t.topic, t.partition)):
                log = self._broker.topics[tp.topic][tp.partition]
                pos = self._positions[tp]
                take = log[pos : pos + (limit - len(out))]
                if take:
                    out.extend(take)
                    self._positions[tp] = pos + len(take)
                if len(out) >= limit:
                    break
            if out:
                return out
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return []
            async with self._broker.changed:
                try:
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for returns normally when the
                    # caller is cancelled just as the wait ends, and the cancellation is lost.
                    async with asyncio.timeout(remaining):
                        await self._broker.changed.wait()
                except TimeoutError:
                    return []

    async def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        if self.group_id is None:
            raise ValueError("a reader (no group) has nothing to commit to")
        group = self._broker.groups[self.group_id]
        if offsets is None:
            offsets = {tp: pos for tp, pos in self._positions.items()}
        for tp, off in offsets.items():
            if tp not in self._assigned:
                raise CommitFailed(f"{tp} is not assigned to this consumer (rebalanced away)")
            group.committed[tp] = off

    async def committed(self, tp: TopicPartition) -> int | None:
        if self.group_id is None:
            return None
        return self._broker.groups[self.group_id].committed.get(tp)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp not in self._assigned:
            raise ValueError(f"{tp} is not assigned to this consumer")
        self._positions[tp] = offset

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    async def caught_up(self) -> bool:
        return bool(self._assigned) and all(
            self._positions[tp] >= len(self._broker.topics[tp.topic][tp.partition]) for tp in self._assigned
        )

    async def lag(self) -> dict[TopicPartition, int]:
        return {tp: len(self._broker.topics[tp.topic][tp.partition]) - self._positions[tp] for tp in self._assigned}

    async def close(self) -> None:
        if not self._started:
            return
        self._started = False
        if self.group_id is None:
            self._assigned, self._positions = set(), {}
            return
        group = self._broker.groups[self.group_id]
        group.members.remove(self)
        self._assigned = set()
        self._positions = {}
        if group.members:
            await self._broker.rebalance(self.group_id)


class MemoryTransport:
    def __init__(self, broker: MemoryBroker | None = None, partitions: int = 4) -> None:
        self.broker = broker or MemoryBroker(partitions)

    async def create_topics(self, specs: Sequence[TopicSpec]) -> None:
        for spec in specs:
            self.broker.create_topic(spec.name, spec.partitions)

    async def list_topics(self) -> list[str]:
        return sorted(self.broker.topics)

    def producer(self) -> MemoryProducer:
        return MemoryProducer(self.broker)

    def consumer(
        self,
        topics: Sequence[str],
        group_id: str | None,
        *,
        from_beginning: bool = True,
        on_assigned: RebalanceCallback | None = None,
        on_revoked: RebalanceCallback | None = None,
    ) -> MemoryConsumer:
        return MemoryConsumer(self.broker, topics, group_id, from_beginning, on_assigned, on_revoked)

    async def close(self) -> None:
        pass
