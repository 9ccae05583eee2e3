"""The run config's backend sections: which transport, object store and Celery broker a run
uses, each a discriminated union on its ``type`` field (``conveyor/config.py`` assembles them into
the run config; import them from there)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote, unquote, urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FilePath,
    PlainSerializer,
    SecretStr,
    SerializationInfo,
    field_validator,
    model_validator,
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------
# secrets and the helpers the sections below share

REVEAL_SECRETS = "reveal_secrets"
"""``model_dump(mode="json", context={REVEAL_SECRETS: True})`` writes secrets in clear: only for a
config handed to a child process (the supervisor's run config), never for one that is shown."""


def _dump_secret(value: SecretStr, info: SerializationInfo) -> str:
    return value.get_secret_value() if (info.context or {}).get(REVEAL_SECRETS) else str(value)


Secret = Annotated[SecretStr, PlainSerializer(_dump_secret, return_type=str, when_used="json")]
"""A password or key: ``**********`` in repr, str, logs and JSON/YAML dumps (``config validate
--show``); the value itself only through ``get_secret_value()``."""


def is_loopback_host(host: str | None) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_password(url: str) -> tuple[str, str | None]:
    """``url`` without the password of its user-info part, and that password (percent-decoded)."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url, None
    user, _, password = userinfo.partition(":")
    netloc = f"{user}@{hostport}" if user else hostport
    return parts._replace(netloc=netloc).geturl(), unquote(password)


def _with_password(url: str, password: SecretStr | None) -> str:
    if password is None:
        return url
    parts = urlsplit(url)
    user, at, hostport = parts.netloc.rpartition("@")
    netloc = f"{user}:{quote(password.get_secret_value(), safe='')}@{hostport}"
    return parts._replace(netloc=netloc).geturl()


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
    max_poll_interval_ms: int = Field(3_900_000, ge=1000)
    """A consumer that has not polled for this long is dropped from its group (its partitions move,
    its next commit is refused and its work since is redone). Must exceed the longest wait between
    polls that the run config allows, the storage sink's ``give_up_after_s`` and the reward's
    ``result_timeout_s`` (``conveyor/config_checks.py``); the default leaves 5 minutes above the
    sink's hour. A hung process is still dropped after ``session_timeout_ms``."""

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """PLAINTEXT: neither encryption nor authentication (a broker on loopback or a closed network);
    SSL: TLS; SASL_PLAINTEXT: username and password, unencrypted; SASL_SSL: both. Producer,
    consumer and admin client all use it."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """Required with SASL_*. PLAIN sends the password itself: use it over SASL_SSL only."""
    sasl_username: str | None = None
    sasl_password: Secret | None = None
    """Required with SASL_*; ``CONVEYOR_TRANSPORT__SASL_PASSWORD`` keeps it out of the file."""
    ssl_cafile: FilePath | None = None
    """CA bundle (PEM) the broker's certificate must chain to; None: the system's CAs."""
    ssl_certfile: FilePath | None = None
    """Client certificate (PEM) for brokers that authenticate clients by certificate."""
    ssl_keyfile: FilePath | None = None
    """Private key of ``ssl_certfile`` (None: the key is in the certificate file)."""
    ssl_check_hostname: bool = True
    """The broker's certificate must name the host connected to."""

    @model_validator(mode="after")
    def _heartbeat_below_session(self) -> KafkaTransportConfig:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError("transport.heartbeat_interval_ms must be at most a third of session_timeout_ms")
        return self

    @model_validator(mode="after")
    def _security_settings_used(self) -> KafkaTransportConfig:
        """Credentials or TLS files the protocol would not use are refused, not silently dropped."""
        sasl = {"sasl_mechanism": self.sasl_mechanism, "sasl_username": self.sasl_username,
                "sasl_password": self.sasl_password}  # fmt: skip
        tls = {"ssl_cafile": self.ssl_cafile, "ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile}
        protocol = self.security_protocol
        if protocol.startswith("SASL_"):
            missing = [f"transport.{k}" for k, v in sasl.items() if not v]
            if missing:
                raise ValueError(f"{', '.join(missing)} required with transport.security_protocol {protocol}")
        elif given := [f"transport.{k}" for k, v in sasl.items() if v is not None]:
            raise ValueError(
                f"{', '.join(given)} set but transport.security_protocol is {protocol}: the broker would never "
                "see them (use SASL_SSL, or SASL_PLAINTEXT on a closed network)"
            )
        if not protocol.endswith("SSL") and (given := [f"transport.{k}" for k, v in tls.items() if v is not None]):
            raise ValueError(f"{', '.join(given)} set but transport.security_protocol {protocol} does not use TLS")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("transport.ssl_keyfile needs transport.ssl_certfile (the certificate it belongs to)")
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
    secret_access_key: Secret | None = None
    ca_bundle: FilePath | None = None
    """CA bundle (PEM) the endpoint's certificate must chain to (a private CA); None: the CAs boto3
    trusts by default. Needs an https:// endpoint."""
    verify_tls: bool = True
    """False accepts any certificate from the endpoint, an impostor's included: a test endpoint only."""
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

    @model_validator(mode="after")
    def _tls_settings_used(self) -> S3StoreConfig:
        if self.ca_bundle is not None and not self.verify_tls:
            raise ValueError("object_store.ca_bundle is set but object_store.verify_tls is false: nothing would check it")
        if (self.endpoint_url or "").startswith("http://") and (self.ca_bundle is not None or not self.verify_tls):
            raise ValueError("object_store.ca_bundle / verify_tls need an https:// object_store.endpoint_url")
        return self


ObjectStoreConfig = Annotated[LocalStoreConfig | S3StoreConfig, Field(discriminator="type")]


# --------------------------------------------------------------------------
# celery broker for reward executors


class _CeleryBroker(_Section):
    """What the Redis and RabbitMQ brokers share: credentials kept out of the URLs, and TLS.

    A password written in ``url`` or ``result_backend`` (``redis://user:pass@host/0``) is moved
    into ``password`` / ``result_backend_password`` at load, so the URLs that are shown and
    logged hold none; ``broker_url()`` and ``backend_url()`` put it back for the client library.
    """

    type: str
    url: str
    password: Secret | None = None
    """The broker's password (the user, e.g. a Redis ACL user, is the one named in ``url``);
    ``CONVEYOR_CELERY__PASSWORD`` keeps it out of the file."""
    result_backend: str | None = None
    """Where task results go; None: the broker's Redis (redis), ``rpc://`` replies on the broker (rabbitmq)."""
    result_backend_password: Secret | None = None
    """The password of a separate ``result_backend``."""
    ssl_cafile: FilePath | None = None
    """CA bundle (PEM) the broker's certificate must chain to; None: the system's CAs. TLS settings
    apply to a ``rediss://`` / ``amqps://`` broker and to a ``rediss://`` result backend."""
    ssl_certfile: FilePath | None = None
    """Client certificate (PEM), for brokers that authenticate clients by certificate."""
    ssl_keyfile: FilePath | None = None
    """Private key of ``ssl_certfile`` (None: the key is in the certificate file)."""
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"
    """Whether the broker's certificate is checked; "none" accepts an impostor's (a test broker only)."""

    @model_validator(mode="before")
    @classmethod
    def _passwords_out_of_urls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for url_key, password_key in (("url", "password"), ("result_backend", "result_backend_password")):
            if not isinstance(data.get(url_key), str):
                continue
            data[url_key], password = _split_password(data[url_key])
            if password is not None:
                if data.get(password_key) is not None:
                    raise ValueError(f"celery.{url_key} holds a password and celery.{password_key} is set too: give it once")
                data[password_key] = password
        return data

    @model_validator(mode="after")
    def _tls_settings_used(self) -> _CeleryBroker:
        given = [f"celery.{k}" for k in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(self, k) is not None]
        given += ["celery.ssl_cert_reqs"] if self.ssl_cert_reqs != "required" else []
        if given and not any(u.startswith(("rediss://", "amqps://")) for u in (self.url, self.result_backend or "")):
            raise ValueError(
                f"{', '.join(given)} set but neither celery.url nor celery.result_backend uses TLS (rediss://, amqps://)"
            )
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("celery.ssl_keyfile needs celery.ssl_certfile (the certificate it belongs to)")
        return self

    def broker_url(self) -> str:
        """``url`` with its password: for the client library only, never to show or log."""
        return _with_password(self.url, self.password)


class RedisBrokerConfig(_CeleryBroker):
    type: Literal["redis"] = "redis"
    url: str = "redis://127.0.0.1:6379/0"
    """``redis://[user@]host:port/db``, ``rediss://`` for TLS; the password goes in ``password``."""
    visibility_timeout_s: int = Field(3600, ge=5)
    """Redis redelivers a task unacknowledged for this long (a killed worker's task runs
    again after it): must exceed ``reward.hard_time_limit_s``."""

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis:// or rediss:// URL")
        return v

    def backend_url(self) -> str:
        """Where results go, with its password (the broker's Redis unless ``result_backend`` says)."""
        if self.result_backend is None:
            return self.broker_url()
        return _with_password(self.result_backend, self.result_backend_password)


class RabbitMQBrokerConfig(_CeleryBroker):
    type: Literal["rabbitmq"] = "rabbitmq"
    url: str = "amqp://127.0.0.1:5672//"
    """``amqp://user@host:port/vhost``, ``amqps://`` for TLS; the password goes in ``password``. No user
    means RabbitMQ's ``guest:guest`` account, which is refused for any host but loopback."""

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("amqp://", "amqps://", "pyamqp://")):
            raise ValueError("must be an amqp:// URL")
        return v

    @model_validator(mode="after")
    def _no_default_account_off_loopback(self) -> RabbitMQBrokerConfig:
        parts = urlsplit(self.url)
        host = parts.hostname or "localhost"
        user = unquote(parts.username or "") or "guest"  # what kombu sends for a missing user or password
        password = (self.password.get_secret_value() if self.password else "") or "guest"
        if (user, password) == ("guest", "guest") and not is_loopback_host(host):
            raise ValueError(
                f"celery.url: RabbitMQ's default account guest:guest (also what no credentials mean) on {host}, "
                "which is not loopback: whoever reaches the broker could queue tasks and forge results. Create a "
                "user (rabbitmqctl add_user), name it in celery.url and give its password in celery.password"
            )
        return self

    def backend_url(self) -> str:
        """Where results go, with its password (``rpc://``: replies on the broker, to the caller)."""
        if self.result_backend is None:
            return "rpc://"
        return _with_password(self.result_backend, self.result_backend_password)


class LocalExecutorConfig(_Section):
    """No broker: a local process pool runs reward tasks (embedded mode)."""

    type: Literal["local"] = "local"
    processes: int = Field(2, ge=1, le=256)


CeleryBrokerConfig = Annotated[RedisBrokerConfig | RabbitMQBrokerConfig | LocalExecutorConfig, Field(discriminator="type")]
