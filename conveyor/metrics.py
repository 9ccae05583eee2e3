"""Prometheus metrics shared by every service.

Metrics live in a registry the entry point owns (``make_registry``), not in
the global default one, so tests and embedded mode can run several services
in one process without duplicate-registration errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
            ),
            swaps_refused=Counter(
                "conveyor_weight_swaps_refused", "Weights objects refused (missing, corrupt, misfit)", registry=registry
            ),
            policy_version=Gauge("conveyor_worker_policy_version", "Policy version the engine serves", registry=registry),
            tokens=Counter("conveyor_generated_tokens", "Completion tokens generated", registry=registry),
            registry=registry,
        )


LEARNER_GAUGES = {
    "reward_mean": "Mean reward of the step's samples",
    "reward_std": "Standard deviation of the step's rewards",
    "pass_rate": "Fraction of the step's samples whose verdict was pass",
    "loss": "Policy loss of the step (first update)",
    "kl": "KL divergence to the reference policy (kl_coef > 0)",
    "entropy": "Mean policy entropy over completion tokens",
    "grad_norm": "Gradient norm before clipping",
    "clip_fraction": "Fraction of tokens whose importance ratio was clipped",
    "importance_mean": "Mean importance weight (policy / behaviour)",
    "importance_max": "Largest importance weight",
    "logprob_mismatch_mean": "Mean |learner - engine| log-prob of the sampled tokens, at the version they were sampled with",
    "logprob_mismatch_max": "Largest |learner - engine| log-prob of a sampled token",
    "lr": "Learning rate",
}
"""The learner's per-step scalars, exported as ``conveyor_learner_<name>`` gauges (the step's value)."""
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


@dataclass
class LearnerMetrics:
    """The learner's RL signals: the same step rows as its ``metrics.jsonl``, as Prometheus series.

    Counters come from the learner's cumulative counts (restored with a checkpoint): each step adds
    what they grew by, so a restarted learner's counters start from zero, as Prometheus expects."""

    step: Gauge
    version: Gauge
    scalars: dict[str, Gauge]
    samples: Counter
    tokens: Counter
    staleness: Histogram
    step_seconds: Histogram
    events: Counter
    registry: CollectorRegistry
    _seen: dict[str, int] = field(default_factory=dict)  # the counts already counted

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> LearnerMetrics:
        registry = registry if registry is not None else make_registry()
        return cls(
            step=Gauge("conveyor_learner_step", "Optimizer steps taken", registry=registry),
            version=Gauge("conveyor_learner_policy_version", "Newest policy version", registry=registry),
            scalars={name: Gauge(f"conveyor_learner_{name}", doc, registry=registry) for name, doc in LEARNER_GAUGES.items()},
            samples=Counter(
                "conveyor_learner_trained_samples",
                "Samples trained on (the others are counted by reason in conveyor_learner_events_total)",
                registry=registry,
            ),
            tokens=Counter("conveyor_learner_trained_tokens", "Completion tokens trained on", registry=registry),
            staleness=Histogram(
                "conveyor_learner_sample_staleness_versions",
                "Versions between a sample's policy and the step that took it",
                buckets=STALENESS_BUCKETS,
                registry=registry,
            ),
            step_seconds=Histogram(
                "conveyor_learner_step_seconds",
                "Time of one step (preparation and updates)",
                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                registry=registry,
            ),
            events=Counter(
                "conveyor_learner_events",
                "Samples, groups and batches dropped, skipped or waited for, by "
                "reason (samples_zero_variance, samples_stale_dropped, duplicates_skipped, batches_untrained, ...)",
                ["reason"],
                registry=registry,
            ),
            registry=registry,
        )

    def start(self, counts: dict[str, int]) -> None:
        """The learner's counts when it started (restored from a checkpoint): counted from here."""
        self._seen = dict(counts)

    def observe(self, row: dict, counts: dict[str, int]) -> None:
        """Take one step's row (``metrics.jsonl``'s) and the learner's cumulative counts."""
        self.step.set(row["step"])
        self.version.set(row["version"])
        for name, gauge in self.scalars.items():
            value = row.get(name)
            if isinstance(value, (int, float)):
                gauge.set(value)
        self.samples.inc(int(row.get("trained_samples") or 0))
        if row.get("loss") is not None:
            self.tokens.inc(float(row.get("tokens") or 0))
        for versions, n in (row.get("staleness") or {}).items():
            for _ in range(int(n)):
                self.staleness.observe(int(versions))
        if row.get("step_s") is not None:
            self.step_seconds.observe(float(row["step_s"]))
        for reason, total in counts.items():
            grew = total - self._seen.get(reason, 0)
            self._seen[reason] = total
            if grew > 0:
                self.events.labels(reason).inc(grew)


_process: TransportMetrics | None = None
_registry: CollectorRegistry | None = None
_rollout: RolloutMetrics | None = None
_learner: LearnerMetrics | None = None


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


def process_learner_metrics() -> LearnerMetrics | None:
    """The learner's metrics on the process registry (None in embedded mode)."""
    global _learner
    if _learner is None and _registry is not None:
        _learner = LearnerMetrics.create(_registry)
    return _learner


def process_metrics() -> TransportMetrics | None:
    return _process
