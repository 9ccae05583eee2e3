"""A service's clients close even when the cancellation of its heartbeat loop is lost.

Python 3.11's ``asyncio.wait_for`` returns normally when the task awaiting it is
cancelled in the same loop turn as the awaited future completes: the heartbeat
loop would then go on beating and ``ServiceClients.__aexit__`` wait for it for good
(a demo stuck at shutdown: "rollout-worker still running 120 s after being told
to stop"). So the loop also ends on a flag that close sets.
"""

from __future__ import annotations

import asyncio

from conveyor.contracts import Heartbeat, decode
from conveyor.messaging import ServiceClients
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport


async def test_close_ends_the_heartbeat_loop_even_if_its_cancellation_is_lost():
    transport = MemoryTransport()
    topics = Topics("r")
    await transport.create_topics([])
    io = ServiceClients(transport, topics.dead_letter, "rollout-worker", heartbeats=topics)
    await io.__aenter__()
    watcher = transport.consumer([topics.heartbeats], "watch")
    await watcher.start()
    records = []
    async with asyncio.timeout(10):
        while not records:  # the loop beats
            records = await watcher.getmany(timeout_s=0.2, max_records=10)
    assert decode(records[0].value, Heartbeat).role == "rollout-worker"
    beating = io._beating
    beating.cancel = lambda *a, **k: False  # the cancellation is lost, as wait_for lost it
    closing = asyncio.create_task(io.__aexit__(None, None, None))
    try:
        done, _ = await asyncio.wait({closing}, timeout=3)  # a beat interval is 5 s: not the next beat
        assert closing in done and beating.done(), "close waited on a heartbeat loop that outlived its cancellation"
    finally:
        del beating.cancel  # (on failure: really end it, and the close with it)
        beating.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        await watcher.close()
