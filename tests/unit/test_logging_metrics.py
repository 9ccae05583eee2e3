from __future__ import annotations

import asyncio
import json

import structlog
from prometheus_client import generate_latest

from conveyor.contracts import Task
from conveyor.logging import configure_logging
from conveyor.messaging import DeadLetterSink, Publisher, Subscriber
from conveyor.metrics import TransportMetrics, make_registry
from conveyor.transport.memory import MemoryTransport


def test_json_logs_carry_bound_context(capsys):
    configure_logging("reward-bridge", fmt="json", level="info", run_id="r1")
    structlog.contextvars.bind_contextvars(task_id="t9")
    structlog.get_logger("x").info("scored", reward=1.0)
    structlog.get_logger("x").debug("hidden")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == 1
    assert (
        lines[0] | {"service": "reward-bridge", "run_id": "r1", "task_id": "t9", "event": "scored", "level": "info"} == lines[0]
    )
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_library_log_lines_are_json_lines_too(capsys):
    """aiokafka, botocore, celery and uvicorn log through the standard library: in a JSON stream
    their lines are JSON with the service's context and the logger's name, exceptions included."""
    import logging

    configure_logging("storage-sink", fmt="json", level="info", run_id="r2")
    logging.getLogger("aiokafka.consumer").warning("heartbeat failed for %s", "group-1")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("botocore").exception("request failed")
    logging.getLogger("celery").debug("hidden")
    import socket
    import threading

    thread = threading.Thread(target=lambda: logging.getLogger("s3transfer").warning("retrying part"))
    thread.start()
    thread.join()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(x["logger"], x["event"], x["service"], x["run_id"], x["host"]) for x in lines] == [
        ("aiokafka.consumer", "heartbeat failed for group-1", "storage-sink", "r2", socket.gethostname()),
        ("botocore", "request failed", "storage-sink", "r2", socket.gethostname()),
        ("s3transfer", "retrying part", "storage-sink", "r2", socket.gethostname()),  # another thread: the same fields
    ]
    assert "ValueError: boom" in lines[1]["exception"]
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    logging.basicConfig(force=True)


async def test_transport_metrics_count_what_happened():
    registry = make_registry()
    metrics = TransportMetrics.create(registry)
    transport = MemoryTransport(partitions=1)
    producer = transport.producer()
    pub = Publisher(producer, "tasks", metrics=metrics)
    await pub.publish_and_wait(Task(task_id="a", run_id="r", prompt="p"), "a")
    await producer.send_and_wait("tasks", b"junk")
    sub = Subscriber(transport, ["tasks"], "g", Task, dead_letters=DeadLetterSink(producer, "dl", "s"), metrics=metrics)
    await sub.start()
    assert len(await sub.poll(timeout_s=0.1)) == 1
    text = generate_latest(registry).decode()
    assert 'conveyor_messages_published_total{topic="tasks"} 1.0' in text
    assert 'conveyor_messages_consumed_total{topic="tasks"} 1.0' in text
    assert 'conveyor_messages_dead_lettered_total{reason="DecodeError",topic="tasks"} 1.0' in text


async def test_consumer_lag_is_a_gauge_per_partition_and_publish_latency_is_timed(monkeypatch):
    from conveyor import messaging

    monkeypatch.setattr(messaging, "LAG_EVERY_S", 0.0)  # every poll refreshes the gauges
    registry = make_registry()
    metrics = TransportMetrics.create(registry)
    transport = MemoryTransport(partitions=2)
    await transport.create_topics([])
    producer = transport.producer()
    pub = Publisher(producer, "tasks", metrics=metrics)
    for i in range(6):
        await pub.publish_and_wait(Task(task_id=f"t{i}", run_id="r", prompt="p"), f"k{i}")
    sub = Subscriber(transport, ["tasks"], "g", Task, dead_letters=DeadLetterSink(producer, "dl", "s"), metrics=metrics)
    await sub.start()
    got = await sub.poll(timeout_s=0.1, max_records=2)
    lag = {p: registry.get_sample_value("conveyor_consumer_lag_records", {"topic": "tasks", "partition": p, "group": "g"})
           for p in ("0", "1")}  # fmt: skip
    assert len(got) == 2 and sum(lag.values()) == 4  # six published, two read
    await sub.poll(timeout_s=0.1)
    assert registry.get_sample_value("conveyor_consumer_lag_records", {"topic": "tasks", "partition": "0", "group": "g"}) == 0
    await asyncio.sleep(0)  # the acknowledgements' callbacks run on the loop's next turn
    assert registry.get_sample_value("conveyor_publish_seconds_count", {"topic": "tasks"}) == 6
    await sub.close()  # its partitions' series go with it
    assert registry.get_sample_value("conveyor_consumer_lag_records", {"topic": "tasks", "partition": "0", "group": "g"}) is None


def test_a_line_logged_under_a_traced_span_carries_its_ids(capsys):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from conveyor.observability_config import TracingConfig
    from conveyor.tracing import configure_tracing, reset_tracing, tracer

    configure_logging("rollout-worker", fmt="json", level="info")
    configure_tracing(TracingConfig(sample_ratio=1.0), "unit", "r", exporter=InMemorySpanExporter())
    try:
        with tracer().start_as_current_span("generate") as span:
            structlog.get_logger("x").info("inside")
        structlog.get_logger("x").info("outside")
    finally:
        reset_tracing()
    inside, outside = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x") and "trace_id" not in outside
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_log_lines_during_a_progress_bar_go_above_it(capsys):
    """A CLI's progress bar (rich) owns the terminal while it runs: log lines written meanwhile go through
    it (printed above the bar), not around it onto the same lines."""
    import io
    import logging

    from rich.console import Console

    from launch.cli.progress import progress

    configure_logging("cli", fmt="json", level="info")
    screen = io.StringIO()
    with progress("work", 2, console=Console(file=screen, force_terminal=True, width=120)) as advance:
        structlog.get_logger("x").info("while_the_bar_runs")
        logging.getLogger("lib").warning("a library's line")
        advance(1)
    assert "while_the_bar_runs" in screen.getvalue() and "a library's line" in screen.getvalue()
    assert "while_the_bar_runs" not in capsys.readouterr().err
    structlog.reset_defaults()
