"""Prometheus metrics shared by every service.

Metrics live in a registry the entry point owns (``make_registry``), not in
the global default one, so tests and embedded mode can run several services
in one process without duplicate-registration errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


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
    def create(cls, registry: CollectorRegistry | None = None) -> TransportMetrics:
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


@dataclass
class RolloutMetrics:
    """A rollout worker's engine: weight swaps (latency, refusals), the version it serves, tokens."""

    swap_seconds: Histogram
    swaps_refused: Counter
    policy_version: Gauge
    tokens: Counter
    registry: CollectorRegistry

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> RolloutMetrics:
        registry = registry or make_registry()
        return cls(
            swap_seconds=Histogram(
                "conveyor_weight_swap_seconds",
                "Fetch, verify and swap a weights version",
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                registry=registry,
            ),  # fmt: skip
            swaps_refused=Counter(
                "conveyor_weight_swaps_refused", "Weights objects refused (missing, corrupt, misfit)", registry=registry
            ),
            policy_version=Gauge("conveyor_worker_policy_version", "Policy version the engine serves", registry=registry),
            tokens=Counter("conveyor_generated_tokens", "Completion tokens generated", registry=registry),
            registry=registry,
        )


_process: TransportMetrics | None = None
_registry: CollectorRegistry | None = None
_rollout: RolloutMetrics | None = None


def enable_process_metrics(port: int, addr: str = "0.0.0.0") -> TransportMetrics:
    """One service per process (``conveyor serve``): its transport metrics, served on ``port``.
    Embedded mode never calls this, so several services in one process do not collide."""
    global _process, _registry
    if _process is None:
        _registry = make_registry()
        _process = TransportMetrics.create(_registry)
        serve_metrics(port, _registry, addr)
    return _process


def process_rollout_metrics() -> RolloutMetrics | None:
    """The rollout worker's metrics on the process registry (None in embedded mode)."""
    global _rollout
    if _rollout is None and _registry is not None:
        _rollout = RolloutMetrics.create(_registry)
    return _rollout


def process_metrics() -> TransportMetrics | None:
    return _process
