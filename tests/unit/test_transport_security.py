"""Transport security settings: what the config refuses at load, what each client library is
handed, and that secrets stay out of everything shown or logged.

The local Kafka-protocol broker (tansu 0.6.0) cannot serve TLS or SASL (``tests/integration/
test_secured_connections.py`` says why), so the Kafka clients are checked here by capturing the
arguments aiokafka's producer, consumer and admin client are built with.
"""

from __future__ import annotations

import asyncio
import ssl

import pytest
import structlog
import yaml
from cli import invoke
from tls_support import make_tls_files

from conveyor.backend_config import REVEAL_SECRETS
from conveyor.config import KafkaTransportConfig, S3StoreConfig, parse_run_config
from conveyor.errors import ConfigError

SASL = {"type": "kafka", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": "learner", "sasl_password": "kafka-pw-1"}  # fmt: skip


def refused(section: str, data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_run_config({section: data}, "run.yaml")
    return str(err.value)


# --------------------------------------------------------------------------
# Kafka


@pytest.mark.parametrize("missing", ["sasl_mechanism", "sasl_username", "sasl_password"])
@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "SASL_SSL"])
def test_sasl_needs_mechanism_username_and_password(protocol, missing):
    data = {**SASL, "security_protocol": protocol}
    del data[missing]
    msg = refused("transport", data)
    assert f"transport.{missing}" in msg and f"required with transport.security_protocol {protocol}" in msg


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL"])
def test_credentials_the_protocol_would_not_send_are_refused(protocol):
    msg = refused("transport", {**SASL, "security_protocol": protocol})
    assert "transport.sasl_mechanism, transport.sasl_username, transport.sasl_password set" in msg
    assert f"security_protocol is {protocol}" in msg
    assert "kafka-pw-1" not in msg


def test_tls_files_must_exist_and_need_a_tls_protocol(tmp_path):
    tls = make_tls_files(tmp_path)
    msg = refused("transport", {"type": "kafka", "security_protocol": "SSL", "ssl_cafile": str(tmp_path / "nope.pem")})
    assert "transport.kafka.ssl_cafile" in msg
    msg = refused("transport", {"type": "kafka", "security_protocol": "SASL_PLAINTEXT", **{k: v for k, v in SASL.items()
                                if k.startswith("sasl")}, "ssl_cafile": str(tls["ca"])})  # fmt: skip
    assert "transport.ssl_cafile set but transport.security_protocol SASL_PLAINTEXT does not use TLS" in msg
    msg = refused("transport", {"type": "kafka", "security_protocol": "SSL", "ssl_keyfile": str(tls["key"])})
    assert "transport.ssl_keyfile needs transport.ssl_certfile" in msg


class _Captured:
    """Stands in for an aiokafka client: records its keyword arguments, connects nowhere."""

    calls: list[tuple[str, dict]] = []

    def __init__(self, *args, **kwargs) -> None:
        self.calls.append((type(self).__name__, kwargs))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def subscribe(self, topics, listener=None) -> None:
        pass

    async def list_topics(self) -> list[str]:
        return []


def _capture_aiokafka(monkeypatch) -> list[tuple[str, dict]]:
    import aiokafka
    import aiokafka.admin

    calls: list[tuple[str, dict]] = []
    for module, name in ((aiokafka, "AIOKafkaProducer"), (aiokafka, "AIOKafkaConsumer"), (aiokafka.admin, "AIOKafkaAdminClient")):
        monkeypatch.setattr(module, name, type(name, (_Captured,), {"calls": calls}))
    return calls


async def _start_every_client(cfg: KafkaTransportConfig) -> None:
    from conveyor.transport.kafka import KafkaTransport

    transport = KafkaTransport(cfg)
    producer = transport.producer()
    await producer.start()
    consumer = transport.consumer(["conveyor.t.tasks"], "workers")
    await consumer.start()
    await transport.list_topics()


def test_producer_consumer_and_admin_connect_with_sasl_over_tls(monkeypatch, tmp_path):
    tls = make_tls_files(tmp_path)
    calls = _capture_aiokafka(monkeypatch)
    cfg = parse_run_config({"transport": {**SASL, "ssl_cafile": str(tls["ca"]), "ssl_certfile": str(tls["cert"]),
                                          "ssl_keyfile": str(tls["key"]), "ssl_check_hostname": False}}).transport  # fmt: skip
    asyncio.run(_start_every_client(cfg))
    assert [name for name, _ in calls] == ["AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"]
    for _, kw in calls:
        assert kw["security_protocol"] == "SASL_SSL"
        assert (kw["sasl_mechanism"], kw["sasl_plain_username"], kw["sasl_plain_password"]) == (
            "SCRAM-SHA-512", "learner", "kafka-pw-1")  # fmt: skip
        context = kw["ssl_context"]
        assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_REQUIRED
        assert context.check_hostname is False
        assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "conveyor test CA"),),)]


def test_plaintext_clients_get_neither_tls_nor_sasl(monkeypatch):
    calls = _capture_aiokafka(monkeypatch)
    asyncio.run(_start_every_client(KafkaTransportConfig()))
    assert len(calls) == 3
    for _, kw in calls:
        assert kw["security_protocol"] == "PLAINTEXT"
        assert not {k for k in kw if k.startswith(("sasl", "ssl"))}


def test_an_unreadable_certificate_fails_at_start_not_after_the_retry_deadline(monkeypatch, tmp_path):
    from conveyor.transport.kafka import KafkaProducer

    calls = _capture_aiokafka(monkeypatch)
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    cfg = KafkaTransportConfig(security_protocol="SSL", ssl_cafile=garbage, connect_deadline_s=600)
    with pytest.raises(ConfigError, match="transport.ssl_cafile/ssl_certfile/ssl_keyfile: cannot load"):
        asyncio.run(asyncio.wait_for(KafkaProducer(cfg).start(), 10))
    assert calls == []


# --------------------------------------------------------------------------
# Celery brokers


def test_a_password_in_the_url_becomes_a_secret_and_goes_back_only_to_the_client():
    cfg = parse_run_config({"celery": {"type": "redis", "url": "redis://reward:p%40ss%2Fw0rd@10.1.2.3:6379/2",
                                       "result_backend": "redis://:other-pw@10.1.2.4:6379/0"}})  # fmt: skip
    broker = cfg.celery
    assert broker.url == "redis://reward@10.1.2.3:6379/2" and broker.result_backend == "redis://10.1.2.4:6379/0"
    assert broker.password.get_secret_value() == "p@ss/w0rd"
    assert broker.broker_url() == "redis://reward:p%40ss%2Fw0rd@10.1.2.3:6379/2"
    assert broker.backend_url() == "redis://:other-pw@10.1.2.4:6379/0"
    from kombu.utils.url import url_to_parts

    parts = url_to_parts(broker.broker_url())
    assert (parts.username, parts.password, parts.hostname) == ("reward", "p@ss/w0rd", "10.1.2.3")


def test_a_password_given_twice_is_refused():
    msg = refused("celery", {"type": "redis", "url": "redis://:a@10.1.2.3/0", "password": "b"})
    assert "celery.url holds a password and celery.password is set too" in msg


@pytest.mark.parametrize(
    "url, password",
    [("amqp://guest:guest@rabbit.internal:5672//", None), ("amqp://rabbit.internal:5672//", None),
     ("amqp://guest@10.0.0.7//", None), ("amqps://guest@rabbit.internal//", "guest"), ("amqp://guest:@rabbit//", None)],
)  # fmt: skip
def test_rabbitmq_default_account_off_loopback_is_refused_naming_celery_url(url, password):
    data = {"type": "rabbitmq", "url": url} | ({"password": password} if password else {})
    msg = refused("celery", data)
    assert "celery.url: RabbitMQ's default account guest:guest" in msg and "not loopback" in msg


@pytest.mark.parametrize(
    "url, password",
    [("amqp://guest:guest@127.0.0.1:5672//", None), ("amqp://localhost//", None), ("amqp://guest@[::1]:5672//", None),
     ("amqp://reward@rabbit.internal:5672//", "s3cret"), ("amqp://guest@rabbit.internal//", "changed-guest-pw")],
)  # fmt: skip
def test_rabbitmq_on_loopback_or_with_own_credentials_is_accepted(url, password):
    data = {"type": "rabbitmq", "url": url} | ({"password": password} if password else {})
    assert parse_run_config({"celery": data}).celery.type == "rabbitmq"


def test_celery_tls_settings_need_a_tls_url_and_existing_files(tmp_path):
    tls = make_tls_files(tmp_path)
    msg = refused("celery", {"type": "redis", "url": "redis://10.1.2.3/0", "ssl_cafile": str(tls["ca"])})
    assert "celery.ssl_cafile set but neither celery.url nor celery.result_backend uses TLS" in msg
    msg = refused("celery", {"type": "redis", "url": "rediss://10.1.2.3/0", "ssl_cafile": str(tmp_path / "nope.pem")})
    assert "celery.redis.ssl_cafile" in msg


def test_celery_gets_tls_settings_in_each_librarys_own_names(tmp_path):
    from reward.celery_app import make_app

    tls = make_tls_files(tmp_path)
    files = {"ssl_cafile": str(tls["ca"]), "ssl_certfile": str(tls["cert"]), "ssl_keyfile": str(tls["key"])}
    redis_app = make_app(parse_run_config({"celery": {"type": "redis", "url": "rediss://:pw@10.1.2.3:6380/0", **files}}))
    expected = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(tls["ca"]), "ssl_certfile": str(tls["cert"]),
                "ssl_keyfile": str(tls["key"]), "ssl_check_hostname": True}  # fmt: skip
    assert redis_app.conf.broker_use_ssl == expected and redis_app.conf.redis_backend_use_ssl == expected
    assert redis_app.conf.broker_url == "rediss://:pw@10.1.2.3:6380/0"
    assert "pw" not in redis_app.connection_for_write().as_uri()  # what Celery and kombu print
    rabbit = {"type": "rabbitmq", "url": "amqps://reward@rabbit.internal:5671//", "password": "pw", **files}
    amqp_app = make_app(parse_run_config({"celery": rabbit}))
    assert amqp_app.conf.broker_use_ssl == {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": str(tls["ca"]),
                                            "certfile": str(tls["cert"]), "keyfile": str(tls["key"]),
                                            "server_hostname": None}  # fmt: skip
    plain = make_app(parse_run_config({"celery": {"type": "redis", "url": "redis://127.0.0.1/0"}}))
    assert not plain.conf.broker_use_ssl and not plain.conf.redis_backend_use_ssl


# --------------------------------------------------------------------------
# S3


def _capture_boto3(monkeypatch) -> list[dict]:
    import boto3

    calls: list[dict] = []
    monkeypatch.setattr(boto3, "client", lambda *a, **kw: calls.append(kw))
    return calls


def test_boto3_verifies_against_the_ca_bundle_or_as_configured(monkeypatch, tmp_path):
    from conveyor.objectstore import S3ObjectStore

    tls = make_tls_files(tmp_path)
    calls = _capture_boto3(monkeypatch)
    base = {"endpoint_url": "https://s3.internal:8333", "create_bucket": False}
    S3ObjectStore(S3StoreConfig(**base, ca_bundle=tls["ca"]))
    S3ObjectStore(S3StoreConfig(**base))
    S3ObjectStore(S3StoreConfig(**base, verify_tls=False))
    assert [c["verify"] for c in calls] == [str(tls["ca"]), True, False]


def test_plain_http_to_another_machine_is_warned_about(monkeypatch):
    from conveyor.objectstore import S3ObjectStore

    _capture_boto3(monkeypatch)
    endpoints = ["http://s3.storage.svc:8333", "http://127.0.0.1:18333", "http://localhost:18333", "https://s3.internal"]
    with structlog.testing.capture_logs() as logs:
        for url in endpoints:
            S3ObjectStore(S3StoreConfig(endpoint_url=url, create_bucket=False))
    warned = [e["endpoint"] for e in logs if e["event"] == "s3.plaintext_endpoint"]
    assert warned == ["http://s3.storage.svc:8333"]
    assert logs[0]["log_level"] == "warning"


def test_s3_tls_settings_that_could_not_work_are_refused(tmp_path):
    tls = make_tls_files(tmp_path)
    msg = refused("object_store", {"type": "s3", "endpoint_url": "https://s3.internal", "ca_bundle": str(tls["ca"]),
                                   "verify_tls": False})  # fmt: skip
    assert "object_store.ca_bundle is set but object_store.verify_tls is false" in msg
    msg = refused("object_store", {"type": "s3", "endpoint_url": "http://s3.internal", "ca_bundle": str(tls["ca"])})
    assert "need an https:// object_store.endpoint_url" in msg
    msg = refused("object_store", {"type": "s3", "endpoint_url": "https://s3.internal", "ca_bundle": str(tmp_path / "x")})
    assert "object_store.s3.ca_bundle" in msg


# --------------------------------------------------------------------------
# secrets shown, logged, and handed to child processes

SECRETS = ("kafka-pw-1", "s3-secret-2", "redis-pw-3", "backend-pw-4")
SECRET_CONFIG = {
    "transport": SASL,
    "object_store": {"type": "s3", "endpoint_url": "https://s3.internal", "access_key_id": "k", "secret_access_key": "s3-secret-2"},
    "celery": {"type": "redis", "url": "redis://reward:redis-pw-3@10.1.2.3:6379/0",
               "result_backend": "redis://:backend-pw-4@10.1.2.4:6379/0"},
}  # fmt: skip


def test_config_validate_show_prints_no_secret(monkeypatch, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(SECRET_CONFIG))
    result = invoke(monkeypatch, ["config", "validate", path, "--show"])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output.split("\n", 1)[1])
    assert not [s for s in SECRETS if s in result.output]
    assert shown["transport"]["sasl_password"] == shown["object_store"]["secret_access_key"] == "**********"
    assert shown["celery"]["password"] == shown["celery"]["result_backend_password"] == "**********"
    assert shown["celery"]["url"] == "redis://reward@10.1.2.3:6379/0"


def test_a_logged_config_holds_no_secret():
    cfg = parse_run_config(SECRET_CONFIG)
    with structlog.testing.capture_logs() as logs:
        structlog.get_logger("t").info("config", cfg=cfg, celery=cfg.celery, transport=cfg.transport)
    rendered = structlog.processors.JSONRenderer(default=repr)(None, "info", dict(logs[0]))
    assert "SecretStr('**********')" in rendered
    assert not [s for s in SECRETS if s in rendered or s in repr(cfg) or s in str(cfg)]


def test_a_child_processs_config_carries_the_secrets_only_when_asked():
    cfg = parse_run_config(SECRET_CONFIG)
    shown = cfg.model_dump(mode="json")
    assert not [s for s in SECRETS if s in yaml.safe_dump(shown)]
    child = parse_run_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json", context={REVEAL_SECRETS: True}))))
    assert child.celery.broker_url() == cfg.celery.broker_url() == "redis://reward:redis-pw-3@10.1.2.3:6379/0"
    assert child.transport.sasl_password.get_secret_value() == "kafka-pw-1"
    assert child.object_store.secret_access_key.get_secret_value() == "s3-secret-2"


def test_the_stack_keeps_redis_passwords_off_its_command_line(tmp_path):
    from launch.stack.components import StackPorts, redis_component

    spec = redis_component(StackPorts(), tmp_path / "redis", {"default": "redis-pw-3", "reward": "backend-pw-4"})
    acl = tmp_path / "redis" / "users.acl"
    assert spec.argv[-2:] == ["--aclfile", str(acl)] and not [s for s in SECRETS if s in " ".join(spec.argv)]
    assert acl.stat().st_mode & 0o777 == 0o600
    text = acl.read_text()
    assert "user default on #" in text and "user reward on #" in text and not [s for s in SECRETS if s in text]
    only_named = redis_component(StackPorts(), tmp_path / "r2", {"reward": "x"})
    assert (tmp_path / "r2" / "users.acl").read_text().startswith("user default off\n") and only_named.endpoint
