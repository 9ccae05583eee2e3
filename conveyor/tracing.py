"""OpenTelemetry traces across the pipeline: one task's submit, generate, score, train and store
spans join into one trace, whatever process each runs in.

The trace context travels with the data, in W3C ``traceparent`` form: in Kafka record headers
(``Publisher.publish(..., headers=)``, ``Delivery.record.headers``) and in Celery task headers
(the reward bridge to the reward workers). Each service starts its span as a child of the context
its input record carries and puts its own span's context on what it publishes.

Traces start at the producer (a task submitted over HTTP, or taken from a file or suite), sampled
by ``tracing.sample_ratio``; every later span follows the root's decision (parent-based), so a
sampled task is traced whole and an unsampled one costs a header lookup per service. With no
tracer provider configured (``tracing.exporter: none``, the default, or embedded mode) the
OpenTelemetry API's no-op tracer is used: nothing is recorded or exported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from conveyor.observability_config import TracingConfig

_PROPAGATOR = TraceContextTextMapPropagator()
_HEADERS = ("traceparent", "tracestate")
TRACER_NAME = "conveyor"


_provider: Any = None  # the process's (configure_tracing); None: OpenTelemetry's global one (a no-op unless set)
_tracer: trace.Tracer | None = None  # the process provider's, made once: a span per rollout asks for it


def tracer() -> trace.Tracer:
    if _tracer is not None:
        return _tracer
    return trace.get_tracer_provider().get_tracer(TRACER_NAME)


def configure_tracing(cfg: TracingConfig, service: str, run_id: str, exporter: Any = None, *, batch: bool = False) -> Any:
    """Install the process's tracer provider (``conveyor serve`` and tests): spans of ``service``,
    sampled by ``cfg.sample_ratio`` at the root, exported by OTLP (``cfg.endpoint``), to stdout
    (``console``), or to ``exporter`` when given (the tests' in-memory exporter: each span as it
    ends, or batched in the background as the others with ``batch``). Returns the provider (None
    for ``exporter: none`` and no ``exporter``)."""
    if cfg.exporter == "none" and exporter is None:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "service.namespace": "conveyor", "conveyor.run_id": run_id}),
        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
    )
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    elif cfg.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.endpoint)))
    # Held here, not installed as OpenTelemetry's global provider (which can be set once per process):
    # a test can trace one pipeline and then stop (reset_tracing).
    global _provider, _tracer
    _provider, _tracer = provider, provider.get_tracer(TRACER_NAME)
    return provider


def reset_tracing() -> None:
    """Flush and drop the process's tracer provider: spans are no-ops again."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer = None, None


def headers_of(span: trace.Span | None = None) -> tuple[tuple[str, bytes], ...]:
    """The context of ``span`` (default: the current one) as Kafka record headers; () when it is
    not sampled (nothing to join)."""
    span = span if span is not None else trace.get_current_span()
    if not span.get_span_context().is_valid or not span.get_span_context().trace_flags.sampled:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple((k, v.encode()) for k, v in carrier.items())


def text_headers(span: trace.Span | None = None) -> dict[str, str]:
    """The same as :func:`headers_of`, as text (Celery task headers)."""
    return {k: v.decode() for k, v in headers_of(span)}


def context_from(headers: Sequence[tuple[str, bytes]] | Mapping[str, Any] | None) -> otel_context.Context | None:
    """The trace context carried by a record's headers (bytes values) or a Celery task's (text);
    None when there is none."""
    if not headers:
        return None
    pairs: Iterable[tuple[str, Any]] = headers.items() if isinstance(headers, Mapping) else headers
    carrier = {k: (v.decode("latin-1") if isinstance(v, bytes) else str(v)) for k, v in pairs if k in _HEADERS}
    if "traceparent" not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def start_child(name: str, headers, **attributes: Any) -> trace.Span:
    """A span ``name`` under the context ``headers`` carry; a non-recording span when they carry
    none (the task was not sampled: its later stages are not traced either)."""
    parent = context_from(headers)
    if parent is None:
        return trace.INVALID_SPAN
    return tracer().start_span(name, context=parent, attributes=attributes)


def by_trace(items: Iterable[tuple[Any, Sequence[tuple[str, bytes]]]]) -> dict[bytes, tuple[Sequence[tuple[str, bytes]], list]]:
    """Items with record headers, grouped by the trace their headers carry: trace -> (the first
    item's headers, the items). A stage that handles a task's rollouts together (a learner step, a
    sink flush) opens one span per task, not one per rollout. Items without a trace are left out."""
    out: dict[bytes, tuple[Sequence[tuple[str, bytes]], list]] = {}
    for item, headers in items:
        parent = next((v for k, v in headers if k == "traceparent"), None) if headers else None
        if parent is None:
            continue
        trace_id = parent[3:35]  # version-traceid-spanid-flags
        if trace_id in out:
            out[trace_id][1].append(item)
        else:
            out[trace_id] = (headers, [item])
    return out
