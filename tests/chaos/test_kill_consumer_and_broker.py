"""kill -9 a consumer mid-stream, and the broker under a producer."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from conveyor.transport import TopicSpec
from conveyor.transport.kafka import KafkaTransport

WORKER = Path(__file__).with_name("consumer_worker.py")


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigkilled_consumer_loses_nothing(kafka_cfg, tmp_path):
    topic, group = f"chaos-{uuid.uuid4().hex[:6]}", f"g-{uuid.uuid4().hex[:6]}"
    n = 300

    async def publish():
        transport = KafkaTransport(kafka_cfg)
        await transport.create_topics([TopicSpec(topic, 3)])
        producer = transport.producer()
        await producer.start()
        futures = [await producer.send(topic, str(i).encode(), f"k{i}".encode()) for i in range(n)]
        await asyncio.gather(*futures)
        await producer.close()

    asyncio.run(publish())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out1, out2 = tmp_path / "first.txt", tmp_path / "second.txt"
    first = subprocess.Popen([sys.executable, str(WORKER), kafka_cfg.bootstrap_servers, topic, group, str(out1)], env=env)
    try:
        wait_for(lambda: len(lines(out1)) >= 60, 60, "first worker to process 60 records")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    processed_before_kill = len(lines(out1))
    assert processed_before_kill < n, "the worker finished before it could be killed"

    second = subprocess.Popen([sys.executable, str(WORKER), kafka_cfg.bootstrap_servers, topic, group, str(out2)], env=env)
    try:
        wait_for(lambda: set(lines(out1)) | set(lines(out2)) >= {str(i) for i in range(n)}, 90, "every record")
        time.sleep(1.0)
    finally:
        second.terminate()
        second.wait()
    seen1, seen2 = lines(out1), lines(out2)
    assert set(seen1) | set(seen2) == {str(i) for i in range(n)}
    duplicates = set(seen1) & set(seen2)
    # Only what the dead worker processed after its last commit comes again: at most one batch per partition.
    assert len(duplicates) <= 3 * 5, f"{len(duplicates)} records redelivered: commits were not positional"
    assert len(seen2) == len(set(seen2))


def test_producer_rides_out_a_broker_restart(stack, kafka_cfg):
    """SIGKILL the broker, restart it; a send issued while it is down completes."""
    topic = f"chaos-restart-{uuid.uuid4().hex[:6]}"

    async def scenario():
        transport = KafkaTransport(kafka_cfg.model_copy(update={"connect_deadline_s": 60, "request_timeout_ms": 5000}))
        await transport.create_topics([TopicSpec(topic, 1)])
        producer = transport.producer()
        await producer.start()
        await producer.send_and_wait(topic, b"before")
        await asyncio.to_thread(stack.kill, "kafka")
        pending = asyncio.ensure_future(producer.send_and_wait(topic, b"during"))
        await asyncio.sleep(2.0)
        assert not pending.done()
        await asyncio.to_thread(stack.restart, "kafka")
        result = await asyncio.wait_for(pending, 60)
        await producer.close()
        return result

    result = asyncio.run(scenario())
    assert result.topic == topic  # tansu keeps its log in memory: the topic was auto-created again
