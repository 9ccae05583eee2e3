"""The transport contract, run against the in-memory transport and a real
Kafka-protocol broker started by the project's stack code."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from conveyor.contracts import DeadLetter, Task, decode, encode
from conveyor.messaging import DeadLetterSink, Publisher, Subscriber
from conveyor.transport import TopicSpec
from conveyor.transport.base import Record


@pytest.fixture(params=["memory", "kafka"])
def transport(request):
    if request.param == "memory":
        from conveyor.transport.memory import MemoryTransport

        return MemoryTransport(partitions=4)
    from conveyor.transport.kafka import KafkaTransport

    return KafkaTransport(request.getfixturevalue("kafka_cfg"))


def unique(name: str) -> str:
    return f"t-{name}-{uuid.uuid4().hex[:8]}"


async def drain(consumer, n: int, timeout_s: float = 20.0) -> list[Record]:
    """Read until ``n`` records arrived or ``timeout_s`` passed."""
    out: list[Record] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(out) < n and loop.time() < deadline:
        out.extend(await consumer.getmany(timeout_s=0.5))
    return out


async def wait_assigned(consumers, n_partitions: int, timeout_s: float = 20.0) -> None:
    """Poll until the group's members together hold all partitions, without consuming records."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        held = [tp for c in consumers for tp in c.assignment()]
        if len(held) == n_partitions and len(set(held)) == n_partitions:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"partitions not assigned: {[c.assignment() for c in consumers]}")


async def produce(transport, topic: str, items: list[tuple[bytes, bytes]]) -> None:
    producer = transport.producer()
    await producer.start()
    try:
        futures = [await producer.send(topic, value, key) for key, value in items]
        await asyncio.gather(*futures)
    finally:
        await producer.close()


async def test_order_is_kept_per_key(transport):
    topic = unique("order")
    await transport.create_topics([TopicSpec(topic, 4)])
    items = [(f"k{i % 5}".encode(), f"{i}".encode()) for i in range(200)]
    await produce(transport, topic, items)
    consumer = transport.consumer([topic], unique("g"))
    await consumer.start()
    try:
        records = await drain(consumer, 200)
    finally:
        await consumer.close()
    assert len(records) == 200
    per_key: dict[bytes, list[int]] = {}
    partitions_of_key: dict[bytes, set[int]] = {}
    for r in records:
        per_key.setdefault(r.key, []).append(int(r.value))
        partitions_of_key.setdefault(r.key, set()).add(r.partition)
    for key, values in per_key.items():
        assert values == sorted(values), f"key {key!r} out of order"
    assert all(len(ps) == 1 for ps in partitions_of_key.values()), "a key spread over partitions"


async def test_group_members_split_partitions_and_groups_see_everything(transport):
    topic = unique("split")
    await transport.create_topics([TopicSpec(topic, 4)])
    group = unique("g")
    a = transport.consumer([topic], group)
    b = transport.consumer([topic], group)
    await a.start()
    await b.start()
    try:
        await wait_assigned([a, b], 4)
        assert a.assignment().isdisjoint(b.assignment())
        assert a.assignment() and b.assignment()
        await produce(transport, topic, [(f"k{i}".encode(), f"{i}".encode()) for i in range(100)])
        got_a, got_b = await asyncio.gather(drain(a, 100, 8), drain(b, 100, 8))
        values_a = {r.value for r in got_a}
        values_b = {r.value for r in got_b}
        assert values_a.isdisjoint(values_b), "a record went to two members of one group"
        assert len(values_a | values_b) == 100

        other = transport.consumer([topic], unique("other"))
        await other.start()
        try:
            assert len(await drain(other, 100)) == 100
        finally:
            await other.close()
    finally:
        await a.close()
        await b.close()


async def test_uncommitted_records_are_redelivered_after_consumer_dies(transport):
    topic = unique("redeliver")
    await transport.create_topics([TopicSpec(topic, 2)])
    await produce(transport, topic, [(f"k{i}".encode(), f"{i}".encode()) for i in range(40)])
    group = unique("g")

    first = transport.consumer([topic], group)
    await first.start()
    records = await drain(first, 40)
    assert len(records) == 40
    # Commit only the first half of each partition, as if processing stopped midway.
    half: dict = {}
    for r in records:
        half.setdefault(r.tp, []).append(r)
    committed = {tp: rs[len(rs) // 2].offset for tp, rs in half.items()}
    await first.commit(committed)
    await first.close()  # dies before committing the rest

    expected = {r.value for r in records if r.offset >= committed[r.tp]}
    second = transport.consumer([topic], group)
    await second.start()
    try:
        again = await drain(second, len(expected))
        again += await second.getmany(timeout_s=1.0)  # nothing more may come
    finally:
        await second.close()
    assert {r.value for r in again} == expected
    assert len(again) == len(expected)


async def test_committed_records_are_not_delivered_again(transport):
    topic = unique("commit")
    await transport.create_topics([TopicSpec(topic, 2)])
    await produce(transport, topic, [(b"k", f"{i}".encode()) for i in range(10)])
    group = unique("g")
    c1 = transport.consumer([topic], group)
    await c1.start()
    assert len(await drain(c1, 10)) == 10
    await c1.commit()
    await c1.close()

    await produce(transport, topic, [(b"k", b"new")])
    c2 = transport.consumer([topic], group)
    await c2.start()
    try:
        rest = await drain(c2, 1)
        rest += await c2.getmany(timeout_s=1.0)
    finally:
        await c2.close()
    assert [r.value for r in rest] == [b"new"]


async def test_a_reader_in_no_group_reads_every_partition_whole(transport):
    """What every instance reads whole (weights, progress, the admission ledger): no group, every
    partition from the beginning, ``caught_up`` once read to the end, nothing to commit."""
    topic = unique("reader")
    await transport.create_topics([TopicSpec(topic, 2)])
    await produce(transport, topic, [(f"k{i}".encode(), f"{i}".encode()) for i in range(10)])
    readers = [transport.consumer([topic], None) for _ in range(2)]
    for r in readers:
        await r.start()
    try:
        for r in readers:  # both see everything: they share no group
            assert len(r.assignment()) == 2
            assert sorted(int(x.value) for x in await drain(r, 10)) == list(range(10))
            assert await r.caught_up()
        await produce(transport, topic, [(b"k0", b"10")])
        assert [x.value for x in await drain(readers[0], 1)] == [b"10"]
        assert await readers[0].caught_up()
        with pytest.raises(ValueError):
            await readers[1].commit({next(iter(readers[1].assignment())): 1})
    finally:
        for r in readers:
            await r.close()


async def test_seek_rereads_from_an_offset(transport):
    topic = unique("seek")
    await transport.create_topics([TopicSpec(topic, 1)])
    await produce(transport, topic, [(b"k", f"{i}".encode()) for i in range(10)])
    c = transport.consumer([topic], unique("g"))
    await c.start()
    try:
        first = await drain(c, 10)
        tp = first[0].tp
        c.seek(tp, 7)
        again = await drain(c, 3)
    finally:
        await c.close()
    assert [r.value for r in again] == [b"7", b"8", b"9"]


async def test_garbage_goes_to_dead_letter_and_consumer_carries_on(transport):
    tasks_topic, dl_topic = unique("tasks"), unique("dead-letter")
    await transport.create_topics([TopicSpec(tasks_topic, 1), TopicSpec(dl_topic, 1)])
    producer = transport.producer()
    await producer.start()
    pub = Publisher(producer, tasks_topic)
    await pub.publish_and_wait(Task(task_id="t1", run_id="r", prompt="a"), key="t1")
    await producer.send_and_wait(tasks_topic, b"\xc1not msgpack", b"t2")
    await producer.send_and_wait(
        tasks_topic,
        encode(
            DeadLetter(  # valid msgpack, wrong type
                dead_letter_id="x",
                source_topic="s",
                source_partition=0,
                source_offset=0,
                key=None,
                raw=b"",
                error="",
                service="s",
            )
        ),
        b"t3",
    )
    await pub.publish_and_wait(Task(task_id="t4", run_id="r", prompt="b"), key="t4")

    group = unique("g")
    sub = Subscriber(transport, [tasks_topic], group, Task, dead_letters=DeadLetterSink(producer, dl_topic, "test"))
    await sub.start()
    got = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while len(got) < 2 and loop.time() < deadline:
        got.extend(await sub.poll(timeout_s=0.5))
    await sub.commit()
    await sub.close()
    assert [d.message.task_id for d in got] == ["t1", "t4"]
    assert sub.dead_lettered == 2

    dl = transport.consumer([dl_topic], unique("ops"))
    await dl.start()
    try:
        letters = [decode(r.value, DeadLetter) for r in await drain(dl, 2)]
    finally:
        await dl.close()
    await producer.close()
    assert [letter.raw[:4] for letter in letters] == [b"\xc1not", letters[1].raw[:4]]
    assert letters[0].key == b"t2" and letters[0].source_topic == tasks_topic
    assert "Task" in letters[0].error and letters[0].service == "test"
    assert {letter.source_offset for letter in letters} == {1, 2}

    # The bad records were covered by the commit: a restarted subscriber sees nothing again.
    again = Subscriber(transport, [tasks_topic], group, Task, dead_letters=DeadLetterSink(producer, dl_topic, "test"))
    await again.start()
    try:
        assert await again.poll(timeout_s=3) == []
    finally:
        await again.close()


async def test_send_applies_backpressure_beyond_max_in_flight(kafka_cfg):
    """With room for two records in flight, a third send waits until an earlier one is acknowledged."""
    from conveyor.transport.kafka import KafkaTransport

    transport = KafkaTransport(kafka_cfg.model_copy(update={"max_in_flight_bytes": 2000, "linger_ms": 200}))
    topic = unique("bp")
    await transport.create_topics([TopicSpec(topic, 1)])
    producer = transport.producer()
    await producer.start()
    try:
        f1 = await producer.send(topic, b"1" * 1000)
        f2 = await producer.send(topic, b"2" * 1000)
        third = asyncio.ensure_future(producer.send(topic, b"3" * 1000))
        await asyncio.sleep(0.05)
        assert not third.done(), "third send did not wait for a free slot"
        await asyncio.gather(f1, f2)
        f3 = await asyncio.wait_for(third, 10)
        assert (await f3).offset == 2
    finally:
        await producer.close()
