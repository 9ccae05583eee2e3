"""Prometheus metrics shared by every service.

Metrics live in a registry the entry point owns (``make_registry``), not in
the global default one, so tests and embedded mode can run several services
in one process without duplicate-registration errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server


def make_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass
class TransportMetrics:
    published: Counter
    consumed: Counter
    dead_lettered: Counter
    claim_checked: Counter
    publish_latency: Histogram
    lag: Gauge

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
            lag=Gauge(
                "conveyor_consumer_lag_records",
                "Records in the partition past what this consumer has read (the high watermark of its last fetch)",
                ["topic", "partition", "group"],
                registry=registry,
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
    running: Gauge
    sequences: Gauge
    waiting: Gauge
    admission_wait: Counter
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
            running=Gauge(
                "conveyor_rollout_tasks_running", "Tasks being generated (each a group of sequences)", registry=registry
            ),
            sequences=Gauge("conveyor_rollout_sequences_in_flight", "Sequences the engine is generating", registry=registry),
            waiting=Gauge(
                "conveyor_rollout_tasks_waiting_admission", "Tasks polled and held back by admission control", registry=registry
            ),
            admission_wait=Counter(
                "conveyor_rollout_admission_wait_seconds",
                "Time with tasks waiting for admission and nothing generating (the learner is the bottleneck)",
                registry=registry,
            ),
            registry=registry,
        )


SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass
class RewardMetrics:
    """The reward bridge: verdicts by verifier kind and outcome, time to a verdict, work in flight."""

    verdicts: Counter
    scoring_seconds: Histogram
    sandbox_seconds: Histogram
    in_flight: Gauge
    judge_verdicts: Counter
    judge_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> RewardMetrics:
        registry = registry if registry is not None else make_registry()
        return cls(
            verdicts=Counter(
                "conveyor_reward_verdicts", "Rollouts scored, by verifier kind and verdict", ["kind", "verdict"], registry=registry
            ),
            scoring_seconds=Histogram(
                "conveyor_reward_scoring_seconds",
                "From submitting a rollout to its verdict (executor queue and verifier)",
                ["kind"],
                buckets=SECONDS_BUCKETS,
                registry=registry,
            ),
            sandbox_seconds=Histogram(
                "conveyor_reward_sandbox_seconds",
                "Time the rollout's code ran in the sandbox (verifiers that run code)",
                ["kind"],
                buckets=SECONDS_BUCKETS,
                registry=registry,
            ),
            in_flight=Gauge(
                "conveyor_reward_in_flight_rollouts", "Rollouts taken and not yet published scored (the executors' queue)",
                registry=registry,
            ),
            judge_verdicts=Counter(
                "conveyor_reward_judge_verdicts", "LLM-judge verdicts by source: cache, endpoint, or failed (no score)",
                ["source"], registry=registry,
            ),
            judge_seconds=Histogram(
                "conveyor_reward_judge_request_seconds", "One LLM-judge request, retries included (not its wait for a slot)",
                buckets=SECONDS_BUCKETS, registry=registry,
            ),
        )  # fmt: skip

    def observe(self, kind: str, verdict: str, seconds: float, details: dict[str, float]) -> None:
        self.verdicts.labels(kind, verdict).inc()
        self.scoring_seconds.labels(kind).observe(seconds)
        if "duration_s" in details:
            self.sandbox_seconds.labels(kind).observe(details["duration_s"])
        # An LLM judge's figures travel in the verdict's details: its Celery pool process serves no metrics.
        if "judge_failed" in details:
            self.judge_verdicts.labels("failed").inc()
        elif "judge_cached" in details:
            self.judge_verdicts.labels("cache" if details["judge_cached"] else "endpoint").inc()
        if "judge_seconds" in details:
            self.judge_seconds.observe(details["judge_seconds"])


@dataclass
class SinkMetrics:
    """The storage sink: rows and bytes stored in the lake, and how long a flush takes."""

    rows: Counter
    bytes: Counter
    parts: Counter
    flush_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> SinkMetrics:
        registry = registry if registry is not None else make_registry()
        return cls(
            rows=Counter("conveyor_lake_rows", "Rollouts stored in the lake", registry=registry),
            bytes=Counter("conveyor_lake_bytes", "Bytes of Parquet parts stored in the lake", registry=registry),
            parts=Counter("conveyor_lake_parts", "Parquet parts stored in the lake", registry=registry),
            flush_seconds=Histogram(
                "conveyor_lake_flush_seconds",
                "From a flush's start to every part stored (retries included)",
                buckets=SECONDS_BUCKETS,
                registry=registry,
            ),
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
    "importance_mean": "Mean importance weight (policy / behaviour) over trained tokens",
    "importance_max": "Largest importance weight of a trained token",
    "logprob_mismatch_mean": "Mean |learner - engine| log-prob of the sampled tokens, at the version they were sampled with",
    "logprob_mismatch_max": "Largest |learner - engine| log-prob of a sampled token",
    "lr": "Learning rate",
    "cp_pad_tokens": "Padding tokens that made the step's packs split evenly over a context-parallel group",
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
    phase_seconds: Counter
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
            phase_seconds=Counter(
                "conveyor_learner_phase_seconds",
                "Learner time by phase: wait (for a complete batch), compute (the step), publish (held by the "
                "previous publication, the progress report, the commit or a checkpoint)",
                ["phase"],
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
        for phase, column in (("wait", "wait_s"), ("compute", "step_s"), ("publish", "publish_s")):
            if row.get(column) is not None:
                self.phase_seconds.labels(phase).inc(float(row[column]))
        for reason, total in counts.items():
            grew = total - self._seen.get(reason, 0)
            self._seen[reason] = total
            if grew > 0:
                self.events.labels(reason).inc(grew)


_process: TransportMetrics | None = None
_registry: CollectorRegistry | None = None
_made: dict[str, Any] = {}  # each service's metrics on the process registry


def enable_process_metrics(port: int, addr: str = "0.0.0.0") -> TransportMetrics:
    """One service per process (``conveyor serve``): its transport metrics, served on ``port``.
    Embedded mode never calls this, so several services in one process do not collide."""
    global _process, _registry
    if _process is None:
        _registry = make_registry()
        ProcessCollector(registry=_registry)  # process_* (CPU, memory, open files), as the default registry has
        _process = TransportMetrics.create(_registry)
        serve_metrics(port, _registry, addr)
    return _process


def _on_process_registry(name: str, make: Callable[[CollectorRegistry], Any]) -> Any:
    """A service's metrics on the process registry, made once (None in embedded mode)."""
    if _registry is None:
        return None
    if name not in _made:
        _made[name] = make(_registry)
    return _made[name]


def process_rollout_metrics() -> RolloutMetrics | None:
    return _on_process_registry("rollout", RolloutMetrics.create)


def process_learner_metrics() -> LearnerMetrics | None:
    return _on_process_registry("learner", LearnerMetrics.create)


def process_reward_metrics() -> RewardMetrics | None:
    return _on_process_registry("reward", RewardMetrics.create)


def process_sink_metrics() -> SinkMetrics | None:
    return _on_process_registry("sink", SinkMetrics.create)


def process_tracker_failures() -> Counter | None:
    """Calls an experiment tracker failed (conveyor/tracking.py)."""
    return _on_process_registry(
        "tracker",
        lambda r: Counter("conveyor_tracker_failures", "Experiment-tracker calls that failed (the run went on)", registry=r),
    )


class _Passthrough:
    """Series an engine library registers on prometheus_client's default registry (vLLM's ``vllm:*``:
    prefix-cache queries and hits, KV-cache usage, running and waiting requests, speculative
    acceptance), served on the process's own port with its other series."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def collect(self):
        from prometheus_client import REGISTRY

        for metric in REGISTRY.collect():
            if metric.name.startswith(self.prefix):
                yield metric


def serve_library_series(prefix: str) -> bool:
    """Serve the default registry's series named ``prefix...`` on the process registry (once; False in
    embedded mode, where nothing is served)."""

    def register(registry: CollectorRegistry) -> bool:
        registry.register(_Passthrough(prefix))
        return True

    return bool(_on_process_registry(f"passthrough:{prefix}", register))


def process_registry() -> CollectorRegistry | None:
    """The registry served on the process's metrics port (None in embedded mode)."""
    return _registry


def process_metrics() -> TransportMetrics | None:
    return _process
