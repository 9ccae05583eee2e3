"""The run config's backend sections: which transport, object store and Celery broker a run
uses, each a discriminated union on its ``type`` field (``conveyor/config.py`` assembles them into
the run config; import them from there)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------
# transport


class MemoryTransportConfig(_Section):
    """In-process topics (embedded mode, tests). Same semantics as Kafka."""

    type: Literal["memory"] = "memory"
    partitions: int = Field(4, ge=1, le=1024)
    """Partitions per topic."""


class KafkaTransportConfig(_Section):
    """Kafka (or any Kafka-protocol broker) through aiokafka."""

    type: Literal["kafka"] = "kafka"
    bootstrap_servers: str = "127.0.0.1:19092"
    """Comma-separated host:port list."""
    partitions: int = Field(4, ge=1, le=1024)
    """Partitions per topic when Conveyor creates the topic."""
    replication_factor: int = Field(1, ge=1, le=7)
    """Replicas per partition when Conveyor creates the topic."""
    client_id: str = "conveyor"
    max_in_flight_bytes: int = Field(64 << 20, ge=1)
    """Bound on unacknowledged bytes: beyond it `send` waits for acknowledgements (backpressure)."""
    max_batch_bytes: int = Field(1 << 20, ge=16 << 10)
    """Producer batch size per partition."""
    linger_ms: int = Field(5, ge=0, le=10_000)
    """How long the producer waits to fill a batch."""
    max_request_bytes: int = Field(8 << 20, ge=1 << 20)
    """Largest request (and so message) the producer sends."""
    request_timeout_ms: int = Field(30_000, ge=1000)
    connect_deadline_s: float = Field(60.0, gt=0)
    """How long start-up and sends retry (with backoff) while the broker is unavailable."""
    session_timeout_ms: int = Field(10_000, ge=1000)
    """A consumer silent this long is removed from its group and its partitions reassigned."""
    heartbeat_interval_ms: int = Field(1_000, ge=100)
    max_poll_interval_ms: int = Field(300_000, ge=1000)

    @model_validator(mode="after")
    def _heartbeat_below_session(self) -> KafkaTransportConfig:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError("transport.heartbeat_interval_ms must be at most a third of session_timeout_ms")
        return self


TransportConfig = Annotated[MemoryTransportConfig | KafkaTransportConfig, Field(discriminator="type")]


# --------------------------------------------------------------------------
# object store


class LocalStoreConfig(_Section):
    """A local directory as object store (embedded mode)."""

    type: Literal["local"] = "local"
    root: Path = Path("runs/objects")
    """Directory holding the objects; created if missing."""


class S3StoreConfig(_Section):
    """Any S3-compatible endpoint through boto3."""

    type: Literal["s3"] = "s3"
    bucket: str = Field("conveyor", min_length=3, max_length=63)
    endpoint_url: str | None = None
    """None: AWS; otherwise e.g. http://127.0.0.1:18333 for the local stack."""
    region: str = "us-east-1"
    access_key_id: str | None = None
    """None: boto3's usual credential chain."""
    secret_access_key: SecretStr | None = None
    prefix: str = ""
    """Key prefix inside the bucket."""
    max_attempts: int = Field(8, ge=1, le=50)
    """boto3 retries (standard mode) per request."""
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(60.0, gt=0)
    multipart_threshold_bytes: int = Field(8 << 20, ge=5 << 20)
    """Objects at least this large are uploaded in parts."""
    multipart_chunk_bytes: int = Field(8 << 20, ge=5 << 20)
    create_bucket: bool = True
    """Create the bucket at start if it does not exist."""
    connect_deadline_s: float = Field(60.0, gt=0)
    """A service that starts while the endpoint does not answer waits (with backoff) this long for it, then fails."""

    @field_validator("prefix")
    @classmethod
    def _prefix_shape(cls, v: str) -> str:
        if v.startswith("/"):
            raise ValueError("must not start with '/'")
        return v


ObjectStoreConfig = Annotated[LocalStoreConfig | S3StoreConfig, Field(discriminator="type")]


# --------------------------------------------------------------------------
# celery broker for reward executors


class RedisBrokerConfig(_Section):
    type: Literal["redis"] = "redis"
    url: str = "redis://127.0.0.1:6379/0"
    result_backend: str | None = None
    """Where task results go; None: the broker's Redis."""
    visibility_timeout_s: int = Field(3600, ge=5)
    """Redis redelivers a task unacknowledged for this long (a killed worker's task runs
    again after it): must exceed ``reward.hard_time_limit_s``."""

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis:// or rediss:// URL")
        return v


class RabbitMQBrokerConfig(_Section):
    type: Literal["rabbitmq"] = "rabbitmq"
    url: str = "amqp://guest:guest@127.0.0.1:5672//"
    result_backend: str | None = None
    """Where task results go; None: ``rpc://`` (replies on the broker, to the caller)."""

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("amqp://", "amqps://", "pyamqp://")):
            raise ValueError("must be an amqp:// URL")
        return v


class LocalExecutorConfig(_Section):
    """No broker: a local process pool runs reward tasks (embedded mode)."""

    type: Literal["local"] = "local"
    processes: int = Field(2, ge=1, le=256)


CeleryBrokerConfig = Annotated[RedisBrokerConfig | RabbitMQBrokerConfig | LocalExecutorConfig, Field(discriminator="type")]
