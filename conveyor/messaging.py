"""Typed publish/subscribe over a transport: codec, claim check, dead letters.

Services never touch bytes. A :class:`Publisher` encodes a contract struct
(and moves it to the object store when it is larger than the claim-check
threshold, ``claim_check:`` in the run config: a message larger than the
broker accepts would otherwise crash-loop its publisher); a :class:`Subscriber` decodes, resolves claim checks, and sends
anything it cannot decode to the dead-letter topic *before* its position can
be committed, so a poison record is neither lost nor blocks the partition.

Usage::

    pub = Publisher(producer, topics.rollouts, claim_check=cc)
    await pub.publish(rollout, key=rollout.task_id)

    sub = Subscriber(transport, [topics.rollouts], topics.group("reward-bridge"), Rollout,
                     dead_letters=DeadLetterSink(producer, topics.dead_letter, "reward-bridge"),
                     claim_check=cc)
    await sub.start()
    for d in await sub.poll():
        await handle(d.message)
    await sub.commit()          # after the work is durable
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import structlog

from conveyor import keys
from conveyor.contracts import (
    ClaimRef,
    DeadLetter,
    DecodeError,
    Message,
    dead_letter_id,
    decode,
    decode_or_claim,
    encode,
)
from conveyor.errors import ChecksumMismatch
from conveyor.transport.base import Consumer, Producer, Record, SendResult, TopicPartition, Transport, next_offsets

if TYPE_CHECKING:
    from conveyor.metrics import TransportMetrics
    from conveyor.objectstore import ObjectStore
    from conveyor.topics import Topics

log = structlog.get_logger(__name__)
HEARTBEAT_S = 5.0
LAG_EVERY_S = 5.0  # how often a subscriber refreshes its lag gauges (a local computation, no request)

M = TypeVar("M", bound=Message)


class ClaimCheck:
    """Moves encoded messages above ``threshold_bytes`` to the object store.

    Objects are content-addressed (``<prefix>/<sha256>``) and written with
    put-if-absent, so a re-published message reuses its object.
    """

    def __init__(self, store: ObjectStore, threshold_bytes: int, prefix: str = "claims") -> None:
        self.store = store
        self.threshold_bytes = threshold_bytes
        self.prefix = prefix.strip("/")

    async def wrap(self, raw: bytes, message_type: str) -> bytes:
        if len(raw) <= self.threshold_bytes:
            return raw
        sha = hashlib.sha256(raw).hexdigest()
        key = keys.claim_key(self.prefix, sha)
        await asyncio.to_thread(self.store.put_if_absent, key, raw)
        ref = ClaimRef(key=key, uri=self.store.uri(key), sha256=sha, size=len(raw), message_type=message_type)
        return encode(ref)

    async def resolve(self, ref: ClaimRef) -> bytes:
        data = await asyncio.to_thread(self.store.get, ref.key, sha256=ref.sha256)
        if len(data) != ref.size:
            raise ChecksumMismatch(f"claim {ref.key}: {len(data)} bytes, expected {ref.size}")
        return data


def claim_check_for(cfg, store: ObjectStore | None) -> ClaimCheck | None:
    """The run config's claim check (``claim_check:``) on ``store``; None without a store."""
    if store is None:
        return None
    return ClaimCheck(store, cfg.claim_check.threshold_bytes, cfg.claim_check.key_prefix)


class Publisher(Generic[M]):
    def __init__(
        self,
        producer: Producer,
        topic: str,
        *,
        claim_check: ClaimCheck | None = None,
        metrics: TransportMetrics | None = None,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.claim_check = claim_check
        self.metrics = metrics

    async def publish(self, msg: M, key: str | None, headers: Sequence[tuple[str, bytes]] = ()) -> Awaitable[SendResult]:
        """Enqueue ``msg``; await the result to know the broker has it. ``headers``: record headers
        (the trace context, ``conveyor/tracing.py``)."""
        raw = encode(msg)
        if self.claim_check is not None and len(raw) > self.claim_check.threshold_bytes:
            raw = await self.claim_check.wrap(raw, str(type(msg).__struct_config__.tag))
            if self.metrics:
                self.metrics.claim_checked.labels(self.topic).inc()
        fut = await self.producer.send(self.topic, raw, key.encode() if key is not None else None, headers)
        if self.metrics:
            self.metrics.published.labels(self.topic).inc()
            if isinstance(fut, asyncio.Future):  # the broker's acknowledgement, timed from the enqueue
                latency, sent = self.metrics.publish_latency.labels(self.topic), time.monotonic()
                fut.add_done_callback(lambda _: latency.observe(time.monotonic() - sent))
        return fut

    async def publish_and_wait(self, msg: M, key: str | None, headers: Sequence[tuple[str, bytes]] = ()) -> SendResult:
        return await (await self.publish(msg, key, headers))


@dataclass(frozen=True)
class Delivery(Generic[M]):
    message: M
    record: Record


DEAD_LETTER_RAW_LIMIT = 256 << 10
DRAINED_AFTER_EMPTY_POLLS = 3
"""A service told to stop drains its input: it is done once the topic stayed quiet this many polls
(one empty poll is not enough: a fetch can come back empty while records are on their way)."""


class DeadLetterSink:
    """Publishes undecodable records to the dead-letter topic and waits for the ack."""

    def __init__(self, producer: Producer, topic: str, service: str) -> None:
        self.producer = producer
        self.topic = topic
        self.service = service

    async def send(self, record: Record, error: str) -> None:
        # An oversized record must not make an oversized dead letter (the broker would refuse it and
        # the service would crash-loop on the same record): keep its head; the whole value stays
        # in the source topic at the recorded offset.
        raw = record.value[:DEAD_LETTER_RAW_LIMIT]
        letter = DeadLetter(
            dead_letter_id=dead_letter_id(record.topic, record.partition, record.offset),
            source_topic=record.topic,
            source_partition=record.partition,
            source_offset=record.offset,
            key=record.key,
            raw=raw,
            error=error[:4000],
            service=self.service,
            raw_size=len(record.value),
            raw_truncated=len(raw) < len(record.value),
        )
        await self.producer.send_and_wait(self.topic, encode(letter), record.key)


class Subscriber(Generic[M]):
    def __init__(
        self,
        transport: Transport,
        topics: Sequence[str],
        group_id: str | None,
        message_type: type[M],
        *,
        dead_letters: DeadLetterSink,
        claim_check: ClaimCheck | None = None,
        from_beginning: bool = True,
        metrics: TransportMetrics | None = None,
        on_assigned=None,
        on_revoked=None,
    ) -> None:
        self.message_type = message_type
        self.dead_letters = dead_letters
        self.claim_check = claim_check
        self.metrics = metrics
        self.consumer: Consumer = transport.consumer(
            topics, group_id, from_beginning=from_beginning, on_assigned=on_assigned, on_revoked=on_revoked
        )
        self.dead_lettered = 0
        self.group = group_id or "none"  # the lag gauges' group label ("none": a reader of every partition)
        self._lag_at = 0.0
        self._lag_labels: set[tuple[str, str, str]] = set()

    async def start(self) -> None:
        await self.consumer.start()

    async def _resolve(self, value: ClaimRef) -> M:
        if self.claim_check is None:
            raise DecodeError(f"claim check {value.key} but this subscriber has no object store")
        return decode(await self.claim_check.resolve(value), self.message_type)

    async def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Delivery[M]]:
        """Decoded messages; undecodable records are dead-lettered and skipped."""
        out: list[Delivery[M]] = []
        for record in await self.consumer.getmany(timeout_s, max_records):
            try:
                msg = decode_or_claim(record.value, self.message_type)
                if type(msg) is ClaimRef:
                    msg = await self._resolve(msg)
            except (DecodeError, ChecksumMismatch, KeyError) as exc:
                # KeyError: the claim-check object is gone (ObjectNotFound).
                await self._dead_letter(record, type(exc).__name__, str(exc))
                continue
            if self.metrics:
                self.metrics.consumed.labels(record.topic).inc()
            out.append(Delivery(msg, record))  # type: ignore[arg-type]  # a ClaimRef was resolved above
        if self.metrics and time.monotonic() - self._lag_at >= LAG_EVERY_S:
            await self._observe_lag()
        return out

    async def _observe_lag(self) -> None:
        """Set one gauge per assigned partition; drop those of partitions a rebalance moved away."""
        assert self.metrics is not None
        self._lag_at = time.monotonic()
        try:
            async with asyncio.timeout(2.0):  # a partition's first position may need a request
                lags = await self.consumer.lag()
        except Exception as exc:  # noqa: BLE001 - a metric never stops a consumer
            log.debug("consumer.lag_unavailable", error=repr(exc)[:200])
            return
        labels = {(tp.topic, str(tp.partition), self.group): n for tp, n in lags.items()}
        for gone in self._lag_labels - labels.keys():
            self._drop_lag(gone)
        for key, n in labels.items():
            self.metrics.lag.labels(*key).set(n)
        self._lag_labels = set(labels)

    async def dead_letter(self, delivery: Delivery[M], reason: str, error: str) -> None:
        """Send a record that decoded but cannot be processed (``reason``: a short class of the
        failure, for the metric) to the dead-letter topic; the caller then treats it as done, so
        the partition moves on past it."""
        await self._dead_letter(delivery.record, reason, error)

    async def _dead_letter(self, record: Record, reason: str, error: str) -> None:
        log.warning(
            "message.dead_lettered",
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            reason=reason,
            error=error[:500],
        )
        await self.dead_letters.send(record, f"{reason}: {error}")
        self.dead_lettered += 1
        if self.metrics:
            self.metrics.dead_lettered.labels(record.topic, reason).inc()

    async def commit(self, deliveries: Sequence[Delivery[M]] | None = None) -> None:
        """Commit ``deliveries`` (positional per partition), or everything polled so far."""
        if deliveries is None:
            await self.consumer.commit()
        else:
            await self.consumer.commit(next_offsets([d.record for d in deliveries]))

    async def commit_offsets(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit explicit positions (the next offset to read per partition)."""
        if offsets:
            await self.consumer.commit(offsets)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.consumer.seek(tp, offset)

    def assignment(self) -> set[TopicPartition]:
        return self.consumer.assignment()

    async def caught_up(self) -> bool:
        return await self.consumer.caught_up()

    async def close(self) -> None:
        for key in self._lag_labels:
            self._drop_lag(key)
        self._lag_labels = set()
        await self.consumer.close()

    def _drop_lag(self, key: tuple[str, str, str]) -> None:
        try:
            self.metrics.lag.remove(*key)  # type: ignore[union-attr]  # labels exist only with metrics
        except KeyError:  # another reader of the same partition in this process removed it
            pass


class ServiceClients:
    """A service's producer, dead-letter sink and subscribers, opened and closed together.

    Every service needs the same wiring: one producer (for its own output and
    for dead letters), a dead-letter sink naming the service, and one or more
    subscribers. Use it as an async context manager::

        async with ServiceClients(transport, topics.dead_letter, "reward-bridge") as io:
            out = io.publisher(topics.scored)
            rollouts = await io.subscribe([topics.rollouts], topics.group("reward-bridge"), Rollout)

    With ``heartbeats`` (the run's topics), it publishes a ``Heartbeat`` naming the service
    every ``HEARTBEAT_S`` seconds while open: ``conveyor status`` counts the instances alive
    from them, on any Kafka-protocol broker (DescribeGroups is not answered by every one).
    """

    def __init__(
        self,
        transport: Transport,
        dead_letter_topic: str,
        service: str,
        *,
        heartbeats: Topics | None = None,
        claim_check: ClaimCheck | None = None,
    ) -> None:
        self.transport = transport
        self.claim_check = claim_check  # every publisher and subscriber's, unless given their own
        self.dead_letter_topic = dead_letter_topic
        self.service = service
        self.producer: Producer = transport.producer()
        self._subscribers: list[Subscriber] = []
        self._heartbeats = heartbeats
        self._beating: asyncio.Task | None = None

    async def __aenter__(self) -> ServiceClients:
        await self.producer.start()
        self.dead_letters = DeadLetterSink(self.producer, self.dead_letter_topic, self.service)
        if self._heartbeats is not None:
            self._closing = asyncio.Event()
            self._beating = asyncio.create_task(self._beat(self._heartbeats))
        return self

    async def _beat(self, topics: Topics) -> None:
        """Best effort: a heartbeat that cannot be sent is skipped, never an error of the service."""
        import os
        import socket

        from conveyor.contracts import Heartbeat
        from conveyor.transport.base import TopicSpec

        instance = f"{socket.gethostname()}:{os.getpid()}"
        pub: Publisher[Heartbeat] = Publisher(self.producer, topics.heartbeats)
        try:
            await self.transport.create_topics([TopicSpec(topics.heartbeats, 1)])
        except Exception as exc:  # noqa: BLE001 - another service may be creating it
            log.debug("heartbeat.topic", error=repr(exc))
        closing = self._closing
        while not closing.is_set():
            try:
                beat = Heartbeat(run_id=topics.run_id, role=self.service, instance=instance, interval_s=HEARTBEAT_S)
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns normally when the task is
                # cancelled just as the send completes, and the loop then outlived its service's close.
                async with asyncio.timeout(HEARTBEAT_S):
                    await (await pub.publish(beat, key=instance))
            except Exception as exc:  # noqa: BLE001 - best effort (a timeout included)
                log.debug("heartbeat.skipped", error=repr(exc))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEARTBEAT_S):
                    await closing.wait()  # the next beat, or close

    def publisher(self, topic: str, **kwargs) -> Publisher:
        from conveyor.metrics import process_metrics

        kwargs.setdefault("metrics", process_metrics())
        kwargs.setdefault("claim_check", self.claim_check)
        return Publisher(self.producer, topic, **kwargs)

    async def subscribe(self, topics: Sequence[str], group_id: str | None, message_type: type[M], **kwargs) -> Subscriber[M]:
        from conveyor.metrics import process_metrics

        kwargs.setdefault("metrics", process_metrics())
        kwargs.setdefault("claim_check", self.claim_check)
        sub = Subscriber(self.transport, topics, group_id, message_type, dead_letters=self.dead_letters, **kwargs)
        await sub.start()
        self._subscribers.append(sub)
        return sub

    async def __aexit__(self, *exc) -> None:
        if self._beating is not None:
            self._closing.set()  # ends the loop even if a cancellation is lost
            self._beating.cancel()
            await asyncio.gather(self._beating, return_exceptions=True)
        for sub in self._subscribers:
            await sub.close()
        await self.producer.close()
