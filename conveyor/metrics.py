"""Prometheus metrics shared by every service.

Metrics live in a registry the entry point owns (``make_registry``), not in
the global default one, so tests and embedded mode can run several services
in one process without duplicate-registration errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server


def make_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass
class TransportMetrics:
    published: Counter
    consumed: Counter
    dead_lettered: Counter
    claim_checked: Counter
    publish_latency: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> "TransportMetrics":
        registry = registry if registry is not None else make_registry()
        return cls(
            published=Counter("conveyor_messages_published", "Messages published", ["topic"], registry=registry),
            consumed=Counter("conveyor_messages_consumed", "Messages decoded and delivered", ["topic"], registry=registry),
            dead_lettered=Counter(
                "conveyor_messages_dead_lettered", "Records sent to the dead-letter topic", ["topic", "reason"], registry=registry
            ),
            claim_checked=Counter(
                "conveyor_messages_claim_checked", "Messages moved to the object store", ["topic"], registry=registry
            ),
            publish_latency=Histogram(
                "conveyor_publish_seconds", "Time from publish to broker acknowledgement", ["topic"], registry=registry
            ),
        )


def serve_metrics(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> None:
    """Expose ``registry`` at http://addr:port/metrics (a daemon thread)."""
    start_http_server(port, addr=addr, registry=registry)


_process: TransportMetrics | None = None


def enable_process_metrics(port: int, addr: str = "0.0.0.0") -> TransportMetrics:
    """One service per process (``conveyor serve``): its transport metrics, served on ``port``.
    Embedded mode never calls this, so several services in one process do not collide."""
    global _process
    if _process is None:
        registry = make_registry()
        _process = TransportMetrics.create(registry)
        serve_metrics(port, registry, addr)
    return _process


def process_metrics() -> TransportMetrics | None:
    return _process
