"""The trace context as record and Celery headers: what is carried, what is not, how a stage
groups a task's rollouts."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from conveyor.observability_config import TracingConfig
from conveyor.tracing import (
    by_trace,
    configure_tracing,
    context_from,
    headers_of,
    reset_tracing,
    start_child,
    text_headers,
    tracer,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def exporter():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    out = InMemorySpanExporter()
    configure_tracing(TracingConfig(sample_ratio=1.0), "unit", "r", exporter=out)
    yield out
    reset_tracing()


def test_a_child_joins_the_trace_its_headers_carry(exporter):
    with tracer().start_as_current_span("submit") as root:
        headers = headers_of(root)
    assert [k for k, _ in headers] == ["traceparent"]
    child = start_child("generate", headers, **{"conveyor.task_id": "t"})
    child.end()
    grandchild = start_child("score", dict(text_headers(child)))  # Celery's text headers
    grandchild.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["generate"].parent.span_id == spans["submit"].context.span_id
    assert spans["score"].parent.span_id == spans["generate"].context.span_id
    assert len({s.context.trace_id for s in spans.values()}) == 1


def test_no_context_no_span_and_no_headers(exporter):
    for headers in ((), None, {}, (("other", b"x"),), (("traceparent", b"garbage"),)):
        assert context_from(headers) is None
        span = start_child("generate", headers)
        assert span is trace.INVALID_SPAN and headers_of(span) == ()
    assert exporter.get_finished_spans() == ()


def test_unsampled_roots_carry_nothing():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    out = InMemorySpanExporter()
    configure_tracing(TracingConfig(sample_ratio=0.0), "unit", "r", exporter=out)
    try:
        with tracer().start_as_current_span("submit") as root:
            assert headers_of(root) == ()  # nothing for later stages to join: they record nothing
    finally:
        reset_tracing()
    assert out.get_finished_spans() == ()


def test_without_a_provider_tracing_is_a_no_op():
    with tracer().start_as_current_span("submit") as root:
        assert not root.is_recording() and headers_of(root) == ()


def test_a_stage_groups_rollouts_by_their_trace():
    a, b = "00-" + "a" * 32 + "-" + "1" * 16 + "-01", "00-" + "b" * 32 + "-" + "2" * 16 + "-01"
    items = [("r1", (("traceparent", a.encode()),)), ("r2", ()), ("r3", (("traceparent", b.encode()),)),
             ("r4", (("traceparent", a.replace("1" * 16, "3" * 16).encode()),))]  # fmt: skip
    groups = by_trace(items)
    assert sorted(ids for _, ids in groups.values()) == [["r1", "r4"], ["r3"]]  # r2 carries no trace
