"""The transport contract: byte-level topics with Kafka semantics.

Two implementations (``memory``, ``kafka``) pass one contract suite
(tests/integration/test_transport_contract.py):

- A topic has N partitions; records with the same key land on the same
  partition and are delivered in the order they were sent.
- Consumers in one group split the partitions between them; each record
  goes to one member. Different groups each see every record.
- Offsets are committed explicitly, after processing. A consumer that dies
  before committing leaves its records to be delivered again to whoever
  takes its partitions (at-least-once). Commits are positional: committing
  a record commits everything before it in its partition.
- ``send`` is bounded: beyond ``max_in_flight`` unacknowledged records it
  waits, which is the back-pressure a slow broker applies to a fast producer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


class CommitFailed(RuntimeError):
    """The partition was reassigned before the commit (a rebalance); its records will be
    redelivered to the new owner. Same meaning for every transport."""


@dataclass(frozen=True)
class TopicPartition:
    topic: str
    partition: int


class Record(NamedTuple):
    """One record as read from a topic (a NamedTuple: cheap on the hot path)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...] = ()

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


@dataclass(frozen=True)
class SendResult:
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    compacted: bool = False  # keep only the last record per key (weights topic)


RebalanceCallback = Callable[[set[TopicPartition]], Awaitable[None]]


class Producer(Protocol):
    async def start(self) -> None: ...

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> Awaitable[SendResult]:
        """Enqueue a record; returns an awaitable that resolves when the broker acknowledged it.

        Waits first while ``max_in_flight`` records are unacknowledged.
        """
        ...

    async def send_and_wait(
        self, topic: str, value: bytes, key: bytes | None = None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> SendResult: ...

    async def flush(self) -> None: ...

    async def close(self) -> None: ...


class Consumer(Protocol):
    async def start(self) -> None: ...

    async def getmany(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Record]:
        """Records from the assigned partitions, in offset order per partition; [] on timeout."""
        ...

    async def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        """Commit ``offsets`` (the *next* offset to read per partition) or, with None,
        everything returned by ``getmany`` so far."""
        ...

    async def committed(self, tp: TopicPartition) -> int | None: ...

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read ``tp`` from ``offset`` on the next ``getmany``."""
        ...

    def assignment(self) -> set[TopicPartition]: ...

    async def caught_up(self) -> bool:
        """Whether this consumer has partitions assigned and has read each of them to the end
        the broker last reported (a reader of a log that must be read whole before acting on it:
        the admission ledger, the newest weights announcement)."""
        ...

    async def lag(self) -> dict[TopicPartition, int]:
        """Per assigned partition, the records past this consumer's position, as of the end the
        broker last reported (no request: for metrics)."""
        ...

    async def close(self) -> None:
        """Leave the group without committing; uncommitted records are redelivered."""
        ...


class Transport(Protocol):
    """Factory for producers and consumers bound to one broker (or process)."""

    async def create_topics(self, specs: Sequence[TopicSpec]) -> None:
        """Create topics that do not exist yet; existing ones are left alone."""
        ...

    async def list_topics(self) -> list[str]: ...

    def producer(self) -> Producer: ...

    def consumer(
        self,
        topics: Sequence[str],
        group_id: str | None,
        *,
        from_beginning: bool = True,
        on_assigned: RebalanceCallback | None = None,
        on_revoked: RebalanceCallback | None = None,
    ) -> Consumer:
        """A consumer in ``group_id``. With no committed offset it starts at the
        beginning (``from_beginning``) or at the end of each partition.

        ``group_id`` None: a *reader*, in no group, assigned every partition of the
        topics (which must exist), never committing: what every instance reads whole
        (weights announcements, progress reports, the admission ledger). It joins no
        group, so it costs the broker's coordinator nothing and is never rebalanced."""
        ...

    async def close(self) -> None: ...


def next_offsets(records: Sequence[Record]) -> dict[TopicPartition, int]:
    """The commit positions that cover ``records`` (max offset + 1 per partition)."""
    out: dict[TopicPartition, int] = {}
    for r in records:
        tp = r.tp
        if out.get(tp, -1) < r.offset + 1:
            out[tp] = r.offset + 1
    return out
