"""The run config's sections about seeing a run: logs, Prometheus metrics, experiment trackers.
Importable from ``conveyor.config`` like every section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from conveyor.backend_config import _Section


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "console", "auto"] = "auto"
    """auto: console on a terminal, JSON lines otherwise."""


class MetricsConfig(_Section):
    port: int | None = Field(None, ge=1, le=65535)
    """Serve Prometheus metrics on this port; None: do not serve."""


class TrackingConfig(_Section):
    """An experiment tracker for the learner and ``conveyor eval``: the run's config, every step's
    scalars (the same as ``metrics.jsonl``), eval results and the final model's location."""

    type: Literal["none", "tensorboard", "mlflow", "wandb"] = "none"
    dir: str | None = None
    """TensorBoard's log directory, W&B's run directory (default: the run directory)."""
    uri: str | None = None
    """MLflow's tracking URI (default: $MLFLOW_TRACKING_URI, else ``sqlite:///<run dir>/mlflow.db``)."""
    project: str = Field("conveyor", min_length=1)
    """The W&B project; the MLflow experiment."""
    wandb_mode: Literal["online", "offline"] | None = None
    """None: $WANDB_MODE, else online (W&B's own default)."""
    max_pending: int = Field(10_000, ge=1)
    """Records waiting for a slow tracker; past it new ones are dropped (counted): it never blocks a step."""


class TracingConfig(_Section):
    """OpenTelemetry traces of each task across the services (``conveyor/tracing.py``)."""

    exporter: Literal["none", "otlp", "console"] = "none"
    endpoint: str | None = None
    """OTLP over HTTP (e.g. http://otel-collector:4318/v1/traces); None: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or its default."""
    sample_ratio: float = Field(0.01, ge=0.0, le=1.0)
    """Share of tasks traced, decided once at the producer; every later span follows it."""
