"""Memory-transport behaviour that the shared contract suite does not reach."""

from __future__ import annotations

from conveyor.transport import TopicPartition
from conveyor.transport.memory import MemoryTransport


async def test_rebalance_callbacks_report_moves():
    transport = MemoryTransport(partitions=2)
    await transport.create_topics([])
    events: list[tuple[str, str, set]] = []

    def cb(name, kind):
        async def inner(tps):
            events.append((name, kind, tps))

        return inner

    a = transport.consumer(["x"], "g", on_assigned=cb("a", "assigned"), on_revoked=cb("a", "revoked"))
    await a.start()
    assert a.assignment() == {TopicPartition("x", 0), TopicPartition("x", 1)}
    b = transport.consumer(["x"], "g", on_assigned=cb("b", "assigned"), on_revoked=cb("b", "revoked"))
    await b.start()
    assert len(a.assignment()) == 1 and len(b.assignment()) == 1
    assert ("a", "revoked", b.assignment()) in events
    await b.close()
    assert len(a.assignment()) == 2


async def test_from_latest_skips_old_records():
    transport = MemoryTransport(partitions=1)
    p = transport.producer()
    await p.send_and_wait("x", b"old")
    c = transport.consumer(["x"], "g", from_beginning=False)
    await c.start()
    await p.send_and_wait("x", b"new")
    assert [r.value for r in await c.getmany(timeout_s=0.1)] == [b"new"]
