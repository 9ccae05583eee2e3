"""The start-up retry shared by the broker and object-store clients, and the GC freeze."""

from __future__ import annotations

import asyncio
import gc
import socket

import pytest
import structlog

from conveyor.runtime import retry_until, startup_frozen


def test_retriable_errors_are_retried_until_success():
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "up"

    with structlog.testing.capture_logs() as logs:
        got = asyncio.run(retry_until("x", flaky, 10, retriable=lambda e: isinstance(e, ConnectionError), event="t.retry",
                                      first_delay_s=0.01))  # fmt: skip
    assert got == "up" and len(calls) == 3
    assert [(e["event"], e["attempt"], e["delay_s"]) for e in logs] == [("t.retry", 1, 0.01), ("t.retry", 2, 0.02)]


def test_other_errors_propagate_at_once_and_the_deadline_gives_up_with_the_callers_error():
    async def broken():
        raise KeyError("bad config")

    with pytest.raises(KeyError):
        asyncio.run(retry_until("x", broken, 10, retriable=lambda e: isinstance(e, ConnectionError), event="t.retry"))

    async def down():
        raise ConnectionError("down")

    with pytest.raises(RuntimeError, match=r"gave up after \d+ attempts") as info:
        asyncio.run(retry_until("x", down, 0.05, retriable=lambda e: True, event="t.retry", first_delay_s=0.01,
                                give_up=lambda exc, n: RuntimeError(f"gave up after {n} attempts")))  # fmt: skip
    assert isinstance(info.value.__cause__, ConnectionError)


def test_a_broker_that_never_answers_ends_in_transport_unavailable():
    from conveyor.config import KafkaTransportConfig
    from conveyor.errors import TransportUnavailable
    from conveyor.transport.kafka import KafkaTransport

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        transport = KafkaTransport(KafkaTransportConfig(bootstrap_servers=f"127.0.0.1:{port}", connect_deadline_s=1.0))
        try:
            await transport.producer().start()
        finally:
            await transport.close()

    with structlog.testing.capture_logs() as logs, pytest.raises(TransportUnavailable, match="broker unavailable after"):
        asyncio.run(go())
    assert any(e["event"] == "kafka.retry" for e in logs)


def test_startup_frozen_freezes_for_the_block_only():
    with startup_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
