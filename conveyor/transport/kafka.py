"""Kafka transport on aiokafka.

- Topics are created through the admin client with the configured partition
  count; an existing topic is left alone.
- Producers use ``acks=all`` and no idempotence/transactions (the local
  broker does not support them; idempotency keys carry exactly-once effect).
  At most ``max_in_flight_bytes`` are unacknowledged at once: beyond that
  ``send`` waits, so a fast producer slows to the broker's pace instead of
  buffering without bound. (One record larger than the bound still goes,
  alone.)
- While the broker is unreachable, start-up and sends retry with exponential
  backoff until ``connect_deadline_s``, then raise ``TransportUnavailable``.
  A retried send may duplicate a record; consumers are idempotent on ids.
- Consumers never auto-commit: offsets are committed by the caller after the
  work they cover is durable. A rebalance listener forwards assignment
  changes to the caller.
- Producer, consumer and admin client connect with the same security
  settings (``security_kwargs``): TLS, SASL or both. The TLS context is built
  before the first attempt, so an unreadable certificate is a ConfigError at
  start, not a broker outage retried until the deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from conveyor.errors import ConfigError, TransportUnavailable
from conveyor.runtime import retry_until
from conveyor.transport.base import CommitFailed, RebalanceCallback, Record, SendResult, TopicPartition, TopicSpec

if TYPE_CHECKING:
    from conveyor.config import KafkaTransportConfig

log = structlog.get_logger(__name__)

_TOPIC_ALREADY_EXISTS = 36


async def _retry(what: str, fn, deadline_s: float, *, first_delay: float = 0.1, max_delay: float = 5.0):
    """Call ``fn`` until it succeeds, backing off on retriable Kafka errors."""
    from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError

    def retriable(exc: BaseException) -> bool:
        if isinstance(exc, (KafkaConnectionError, KafkaTimeoutError, OSError)):
            return True
        return isinstance(exc, KafkaError) and getattr(exc, "retriable", False)

    return await retry_until(
        what, fn, deadline_s, retriable=retriable, event="kafka.retry", first_delay_s=first_delay, max_delay_s=max_delay,
        give_up=lambda exc, attempts: TransportUnavailable(f"{what}: broker unavailable after {attempts} attempts: {exc}"),
    )  # fmt: skip


def security_kwargs(cfg: KafkaTransportConfig) -> dict[str, Any]:
    """aiokafka's keyword arguments for ``cfg``'s security settings (the config checked that the
    protocol has what it needs)."""
    kwargs: dict[str, Any] = {"security_protocol": cfg.security_protocol}
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        try:
            context = create_ssl_context(cafile=cfg.ssl_cafile, certfile=cfg.ssl_certfile, keyfile=cfg.ssl_keyfile)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise ConfigError(f"transport.ssl_cafile/ssl_certfile/ssl_keyfile: cannot load: {exc}") from None
        context.check_hostname = cfg.ssl_check_hostname
        kwargs["ssl_context"] = context
    if cfg.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        kwargs.update(
            sasl_mechanism=cfg.sasl_mechanism,
            sasl_plain_username=cfg.sasl_username,  # aiokafka's name for SCRAM's username too
            sasl_plain_password=cfg.sasl_password.get_secret_value() if cfg.sasl_password else None,
        )
    return kwargs


class KafkaProducer:
    def __init__(self, cfg: KafkaTransportConfig) -> None:
        self.cfg = cfg
        self._producer: Any = None
        self._in_flight_bytes = 0
        self._space = asyncio.Event()
        self._resends: set[asyncio.Task] = set()

    def _make(self, security: dict[str, Any]):
        from aiokafka import AIOKafkaProducer

        return AIOKafkaProducer(
            **security,
            bootstrap_servers=self.cfg.bootstrap_servers,
            client_id=self.cfg.client_id,
            acks="all",
            enable_idempotence=False,
            max_batch_size=self.cfg.max_batch_bytes,
            linger_ms=self.cfg.linger_ms,
            max_request_size=self.cfg.max_request_bytes,
            request_timeout_ms=self.cfg.request_timeout_ms,
        )

    async def start(self) -> None:
        security = security_kwargs(self.cfg)

        async def attempt():
            producer = self._make(security)
            try:
                await producer.start()
            except BaseException:
                await producer.stop()
                raise
            return producer

        self._producer = await _retry("producer.start", attempt, self.cfg.connect_deadline_s)

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> Awaitable[SendResult]:
        size = len(value) + (len(key) if key else 0)
        while self._in_flight_bytes and self._in_flight_bytes + size > self.cfg.max_in_flight_bytes:
            self._space.clear()
            await self._space.wait()
        self._in_flight_bytes += size
        hdrs = list(headers) or None
        try:
            inner = await _retry(
                "producer.send",
                lambda: self._producer.send(topic, value=value, key=key, headers=hdrs),
                self.cfg.connect_deadline_s,
            )
        except BaseException:
            self._release(size)
            raise
        # A plain future resolved from aiokafka's callback: no task per record
        # on the fast path; a failed delivery is retried in a task.
        outer: asyncio.Future[SendResult] = asyncio.get_running_loop().create_future()

        def delivered(fut: asyncio.Future) -> None:
            if fut.cancelled():
                self._release(size)
                outer.cancel()
                return
            exc = fut.exception()
            if exc is None:
                self._release(size)
                md = fut.result()
                if not outer.done():
                    outer.set_result(SendResult(md.topic, md.partition, md.offset))
                return
            task = asyncio.ensure_future(self._resend(outer, exc, size, topic, value, key, hdrs))
            self._resends.add(task)  # keep a reference until it finishes
            task.add_done_callback(self._resends.discard)

        inner.add_done_callback(delivered)
        return outer

    def _release(self, size: int) -> None:
        self._in_flight_bytes -= size
        self._space.set()

    async def _resend(self, outer: asyncio.Future, exc: BaseException, size: int, topic: str, value: bytes, key, hdrs) -> None:
        from aiokafka.errors import KafkaError

        try:
            if not (isinstance(exc, KafkaError) and getattr(exc, "retriable", False)) and not isinstance(
                exc, asyncio.TimeoutError
            ):
                raise exc
            log.warning("kafka.resend", topic=topic, error=str(exc))
            md = await _retry(
                "producer.resend",
                lambda: self._producer.send_and_wait(topic, value=value, key=key, headers=hdrs),
                self.cfg.connect_deadline_s,
            )
            if not outer.done():
                outer.set_result(SendResult(md.topic, md.partition, md.offset))
        except BaseException as final:  # noqa: BLE001 - handed to whoever awaits the send
            if not outer.done():
                outer.set_exception(final)
        finally:
            self._release(size)

    async def send_and_wait(
        self, topic: str, value: bytes, key: bytes | None = None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> SendResult:
        return await (await self.send(topic, value, key, headers))

    async def flush(self) -> None:
        await self._producer.flush()

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None


class _Listener:
    def __init__(self, consumer: KafkaConsumer) -> None:
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked) -> None:
        tps = {TopicPartition(tp.topic, tp.partition) for tp in revoked}
        for tp in tps:
            self._consumer._fetched.pop(tp, None)
        if tps and self._consumer._on_revoked:
            await self._consumer._on_revoked(tps)

    async def on_partitions_assigned(self, assigned) -> None:
        tps = {TopicPartition(tp.topic, tp.partition) for tp in assigned}
        if tps and self._consumer._on_assigned:
            await self._consumer._on_assigned(tps)


class KafkaConsumer:
    def __init__(
        self,
        cfg: KafkaTransportConfig,
        topics: Sequence[str],
        group_id: str | None,
        from_beginning: bool,
        on_assigned: RebalanceCallback | None,
        on_revoked: RebalanceCallback | None,
    ) -> None:
        self.cfg = cfg
        self.topics = list(topics)
        self.group_id = group_id
        self._from_beginning = from_beginning
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._consumer: Any = None
        self._fetched: dict[TopicPartition, int] = {}

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

        listener_impl = _Listener(self)

        class Listener(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked):
                await listener_impl.on_partitions_revoked(revoked)

            async def on_partitions_assigned(self, assigned):
                await listener_impl.on_partitions_assigned(assigned)

        security = security_kwargs(self.cfg)

        async def attempt():
            consumer = AIOKafkaConsumer(
                **security,
                bootstrap_servers=self.cfg.bootstrap_servers,
                client_id=self.cfg.client_id,
                group_id=self.group_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest" if self._from_beginning else "latest",
                session_timeout_ms=self.cfg.session_timeout_ms,
                heartbeat_interval_ms=self.cfg.heartbeat_interval_ms,
                max_poll_interval_ms=self.cfg.max_poll_interval_ms,
                request_timeout_ms=max(self.cfg.request_timeout_ms, self.cfg.session_timeout_ms + 5000),
                fetch_max_bytes=max(self.cfg.max_request_bytes, 52428800),
                max_partition_fetch_bytes=self.cfg.max_request_bytes,
            )
            if self.group_id is not None:
                consumer.subscribe(self.topics, listener=Listener())
            try:
                await consumer.start()
                if self.group_id is None:
                    await self._assign_all(consumer)
            except BaseException:
                await consumer.stop()
                raise
            return consumer

        self._consumer = await _retry("consumer.start", attempt, self.cfg.connect_deadline_s)
        if self.group_id is None and self._on_assigned:
            await self._on_assigned(self.assignment())

    async def _assign_all(self, consumer) -> None:
        """A reader: every partition of its topics, from the beginning (or the end)."""
        from aiokafka import TopicPartition as KTP

        tps = []
        for topic in self.topics:
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                await consumer.topics()  # a metadata request for every topic
                parts = consumer.partitions_for_topic(topic)
            if not parts:
                raise RuntimeError(f"topic {topic} does not exist (yet): a reader needs it created first")
            tps += [KTP(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        if self._from_beginning:
            await consumer.seek_to_beginning(*tps)
        else:
            await consumer.seek_to_end(*tps)

    async def getmany(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Record]:
        batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        out: list[Record] = []
        for tp, records in sorted(batches.items(), key=lambda kv: (kv[0].topic, kv[0].partition)):
            for r in records:
                out.append(
                    Record(
                        r.topic,
                        r.partition,
                        r.offset,
                        r.key,
                        r.value if r.value is not None else b"",
                        r.timestamp,
                        tuple(r.headers or ()),
                    )
                )
            if records:
                self._fetched[TopicPartition(tp.topic, tp.partition)] = records[-1].offset + 1
        return out

    async def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        from aiokafka import TopicPartition as KTP

        if offsets is None:
            offsets = dict(self._fetched)
        if not offsets:
            return
        if self.group_id is None:
            raise ValueError("a reader (no group) has nothing to commit to")
        from aiokafka.errors import CommitFailedError, IllegalStateError

        try:
            await self._consumer.commit({KTP(tp.topic, tp.partition): off for tp, off in offsets.items()})
        except (CommitFailedError, IllegalStateError) as exc:
            raise CommitFailed(str(exc)) from exc

    async def committed(self, tp: TopicPartition) -> int | None:
        from aiokafka import TopicPartition as KTP

        if self.group_id is None:
            return None
        return await self._consumer.committed(KTP(tp.topic, tp.partition))

    def seek(self, tp: TopicPartition, offset: int) -> None:
        from aiokafka import TopicPartition as KTP

        self._consumer.seek(KTP(tp.topic, tp.partition), offset)
        self._fetched.pop(tp, None)

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    async def caught_up(self) -> bool:
        tps = list(self._consumer.assignment())
        if not tps:
            return False
        # tansu answers ListOffsets(latest) with the last batch's base offset + 1 (short of the end
        # when producers batch); the high watermark of the last fetch is right on every broker.
        ends = await self._consumer.end_offsets(tps)
        for tp in tps:
            end = max(ends.get(tp) or 0, self._consumer.highwater(tp) or 0)
            if await self._consumer.position(tp) < end:
                return False
        return True

    async def lag(self) -> dict[TopicPartition, int]:
        out = {}
        for tp in list(self._consumer.assignment()):
            end = self._consumer.highwater(tp)  # from the last fetch response: None before the first
            if end is not None:
                out[TopicPartition(tp.topic, tp.partition)] = max(0, end - await self._consumer.position(tp))
        return out

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None


class KafkaTransport:
    def __init__(self, cfg: KafkaTransportConfig) -> None:
        self.cfg = cfg

    async def _admin(self):
        from aiokafka.admin import AIOKafkaAdminClient

        security = security_kwargs(self.cfg)

        async def attempt():
            admin = AIOKafkaAdminClient(
                **security,
                bootstrap_servers=self.cfg.bootstrap_servers,
                client_id=f"{self.cfg.client_id}-admin",
                request_timeout_ms=self.cfg.request_timeout_ms,
            )
            try:
                await admin.start()
            except BaseException:
                await admin.close()
                raise
            return admin

        return await _retry("admin.start", attempt, self.cfg.connect_deadline_s)

    async def create_topics(self, specs: Sequence[TopicSpec]) -> None:
        from aiokafka.admin import NewTopic

        if not specs:
            return
        admin = await self._admin()
        try:
            new = [
                NewTopic(
                    s.name,
                    s.partitions,
                    self.cfg.replication_factor,
                    topic_configs={"cleanup.policy": "compact"} if s.compacted else {},
                )
                for s in specs
            ]
            resp = await admin.create_topics(new)
            for topic, code, message in resp.topic_errors:
                if code not in (0, _TOPIC_ALREADY_EXISTS):
                    raise RuntimeError(f"cannot create topic {topic}: error {code}: {message}")
        finally:
            await admin.close()

    async def list_topics(self) -> list[str]:
        admin = await self._admin()
        try:
            return sorted(t for t in await admin.list_topics() if not t.startswith("__"))
        finally:
            await admin.close()

    def producer(self) -> KafkaProducer:
        return KafkaProducer(self.cfg)

    def consumer(
        self,
        topics: Sequence[str],
        group_id: str | None,
        *,
        from_beginning: bool = True,
        on_assigned: RebalanceCallback | None = None,
        on_revoked: RebalanceCallback | None = None,
    ) -> KafkaConsumer:
        return KafkaConsumer(self.cfg, topics, group_id, from_beginning, on_assigned, on_revoked)

    async def close(self) -> None:
        pass
