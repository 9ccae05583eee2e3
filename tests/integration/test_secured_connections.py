"""Secured connections against real servers: a reward task through Celery on a Redis-compatible
server with a password and an ACL user, on RabbitMQ as a user of its own, on Redis over TLS,
and the object store over HTTPS with a private CA; wrong credentials fail, naming the cause.

What the local servers cannot test (the unit tests check the arguments the clients get instead):

- Kafka TLS and SASL: tansu 0.6.0 declares ``--cert`` and ``--key`` mutually exclusive (``--cert``
  alone leaves the listener plaintext), and its memory and S3 storage engines do not keep SCRAM
  users, while ``--authentication`` refuses the unauthenticated request that would create the
  first one.
- RabbitMQ over TLS (amqps://): the machine's RabbitMQ listens on plain 5672 only, and on loopback,
  so the refusal of its guest account off loopback is a config test only.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml
from celery_support import Worker, reachable
from conftest import free_port_block, local_redis, service_unavailable
from tls_support import make_tls_files

from conveyor.config import load_run_config, parse_run_config
from conveyor.contracts import Task, VerifierSpec

USER_PW = "acl-" + secrets.token_hex(8)
DEFAULT_PW = "default-" + secrets.token_hex(8)


def write_config(tmp: Path, celery: dict, queue: str) -> Path:
    path = tmp / f"{queue}.yaml"
    path.write_text(yaml.safe_dump({
        "run_id": queue, "celery": celery, "logging": {"level": "info", "format": "json"},
        "reward": {"timeout_s": 6, "soft_time_limit_s": 8, "hard_time_limit_s": 10, "queue": queue, "result_timeout_s": 60},
    }))  # fmt: skip
    return path


def round_trip(tmp: Path, celery: dict) -> str:
    """Score one math answer through a real worker; the worker's log."""
    from reward.build import scorer

    queue = f"sec-{uuid.uuid4().hex[:8]}"
    path = write_config(tmp, celery, queue)
    worker = Worker(path, f"w-{queue}", tmp)
    try:
        worker.wait_for("ready")
        s = scorer(load_run_config(path))
        try:
            task = Task(
                task_id="t", run_id=queue, prompt="p", group_size=1, verifier=VerifierSpec(kind="math", data={"answer": "7"})
            )
            [v] = asyncio.run(s.score([(task, r"\boxed{7}", f"r-{uuid.uuid4().hex}")]))
        finally:
            s.close()
        assert (v.reward, v.verdict) == (1.0, "pass")
    finally:
        worker.stop()
    return worker.log.read_text()


def connect_error(celery: dict) -> str:
    """What connecting with ``celery`` raises (the message a user reads)."""
    from reward.celery_app import make_app

    app = make_app(parse_run_config({"celery": celery}))
    with pytest.raises(Exception) as err, app.connection_for_write() as conn:  # noqa: PT011 - any failure; its text is checked
        conn.ensure_connection(max_retries=1, timeout=5)
    return f"{type(err.value).__name__}: {err.value}"


# --------------------------------------------------------------------------
# Redis-compatible server (the stack's valkey) with a password and an ACL user


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    yield from local_redis(tmp_path_factory.mktemp("acl-redis"), redis_users={"default": DEFAULT_PW, "reward": USER_PW})


def test_celery_round_trip_as_an_acl_user_with_the_password_in_the_url(acl_redis, tmp_path):
    url = acl_redis.replace("redis://", f"redis://reward:{USER_PW}@")
    log = round_trip(tmp_path, {"type": "redis", "url": url, "visibility_timeout_s": 12})
    assert "redis://reward:**@" in log and USER_PW not in log


def test_celery_round_trip_with_the_default_users_password(acl_redis, tmp_path):
    log = round_trip(tmp_path, {"type": "redis", "url": acl_redis, "password": DEFAULT_PW, "visibility_timeout_s": 12})
    assert DEFAULT_PW not in log


@pytest.mark.parametrize(
    "user, password, says",
    [("reward", "wrong", "invalid username-password pair"), ("nobody", USER_PW, "invalid username-password pair"),
     ("", None, "Authentication required")],
    ids=["wrong-password", "unknown-user", "no-credentials"],
)  # fmt: skip
def test_wrong_redis_credentials_fail_naming_the_cause(acl_redis, user, password, says):
    url = acl_redis.replace("redis://", f"redis://{user}@") if user else acl_redis
    error = connect_error({"type": "redis", "url": url, "password": password})
    assert "OperationalError" in error and says in error
    assert USER_PW not in error and DEFAULT_PW not in error


def test_a_worker_with_the_wrong_password_says_so_in_its_log(acl_redis, tmp_path):
    url = acl_redis.replace("redis://", "redis://reward@")
    path = write_config(
        tmp_path, {"type": "redis", "url": url, "password": "wrong-" + USER_PW, "visibility_timeout_s": 12}, "bad"
    )
    worker = Worker(path, "w-bad", tmp_path)
    try:
        worker.wait_for("invalid username-password pair", timeout_s=60)
    finally:
        worker.stop()
    log = worker.log.read_text()
    assert "ready" not in log and "wrong-" + USER_PW not in log


# --------------------------------------------------------------------------
# Redis over TLS (the machine's redis-server: the stack's valkey is built without TLS)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        service_unavailable("redis-server (with TLS) is not installed")
    tmp = tmp_path_factory.mktemp("tls-redis")
    tls = make_tls_files(tmp)
    port = free_port_block(1)
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(tls["cert"]),
         "--tls-key-file", str(tls["key"]), "--tls-ca-cert-file", str(tls["ca"]), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(tmp), "--requirepass", DEFAULT_PW],
        stdout=(tmp / "redis.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not reachable(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                service_unavailable(f"redis-server with TLS did not start: {(tmp / 'redis.log').read_text()[-500:]}")
            time.sleep(0.1)
        yield f"rediss://127.0.0.1:{port}/0", tls["ca"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_celery_round_trip_over_tls_checked_against_a_private_ca(tls_redis, tmp_path):
    url, ca = tls_redis
    log = round_trip(tmp_path, {"type": "redis", "url": url, "password": DEFAULT_PW, "ssl_cafile": str(ca),
                                "visibility_timeout_s": 12})  # fmt: skip
    assert "rediss://:**@127.0.0.1" in log and DEFAULT_PW not in log


def test_a_tls_server_whose_ca_is_not_trusted_is_refused(tls_redis):
    url, _ = tls_redis
    error = connect_error({"type": "redis", "url": url, "password": DEFAULT_PW})  # the system's CAs only
    assert "certificate verify failed" in error


# --------------------------------------------------------------------------
# RabbitMQ with a user of its own (the machine's RabbitMQ, administered with rabbitmqctl)


@pytest.fixture(scope="module")
def rabbit_user():
    if not reachable(5672):
        service_unavailable("the machine's RabbitMQ on port 5672 is not running")
    if shutil.which("rabbitmqctl") is None:
        service_unavailable("rabbitmqctl is not installed: cannot create a RabbitMQ user")
    name, password = f"conveyor-it-{uuid.uuid4().hex[:8]}", "amqp-" + secrets.token_hex(8)

    def ctl(*args: str) -> None:
        out = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            service_unavailable(f"rabbitmqctl {args[0]} failed: {out.stderr.strip()[-300:]}")

    ctl("add_user", name, password)
    try:
        ctl("set_permissions", "-p", "/", name, ".*", ".*", ".*")
        yield name, password
    finally:
        subprocess.run(["rabbitmqctl", "delete_user", name], capture_output=True, timeout=60)


def test_celery_round_trip_as_a_rabbitmq_user_of_its_own(rabbit_user, tmp_path):
    name, password = rabbit_user
    log = round_trip(tmp_path, {"type": "rabbitmq", "url": f"amqp://{name}@127.0.0.1:5672//", "password": password})
    assert f"amqp://{name}:**@127.0.0.1" in log and password not in log


def test_a_wrong_rabbitmq_password_is_refused_by_the_broker(rabbit_user):
    name, password = rabbit_user
    error = connect_error({"type": "rabbitmq", "url": f"amqp://{name}@127.0.0.1:5672//", "password": "wrong"})
    assert "ACCESS_REFUSED" in error and password not in error


# --------------------------------------------------------------------------
# S3 over HTTPS (the stack's SeaweedFS with a certificate from a private CA)


@pytest.fixture(scope="module")
def https_s3(tmp_path_factory):
    import boto3
    from botocore.config import Config

    from launch.stack.components import LOCAL_S3_ACCESS_KEY, LOCAL_S3_SECRET_KEY, BinaryMissing, StackPorts, s3_component

    tmp = tmp_path_factory.mktemp("https-s3")
    tls = make_tls_files(tmp)
    base = free_port_block(11)
    try:
        spec = s3_component(StackPorts.from_base(base), tmp / "data")
    except BinaryMissing as exc:
        service_unavailable(f"weed is not installed: {exc}")
    (tmp / "data").mkdir()
    https = base + 10
    argv = [*spec.argv, f"-s3.cert.file={tls['cert']}", f"-s3.key.file={tls['key']}", f"-s3.port.https={https}"]
    proc = subprocess.Popen(argv, cwd=tmp / "data", stdout=(tmp / "weed.log").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    endpoint = f"https://127.0.0.1:{https}"
    client = boto3.client("s3", endpoint_url=endpoint, verify=str(tls["ca"]), region_name="us-east-1",
                          aws_access_key_id=LOCAL_S3_ACCESS_KEY, aws_secret_access_key=LOCAL_S3_SECRET_KEY,
                          config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                client.list_buckets()
                break
            except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
                if proc.poll() is not None or time.monotonic() > deadline:
                    service_unavailable(f"weed with HTTPS did not serve: {exc}; {(tmp / 'weed.log').read_text()[-500:]}")
                time.sleep(0.5)
        yield {"type": "s3", "endpoint_url": endpoint, "access_key_id": LOCAL_S3_ACCESS_KEY,
               "secret_access_key": LOCAL_S3_SECRET_KEY, "max_attempts": 1, "bucket": "tls-it"}, tls["ca"]  # fmt: skip
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_objects_round_trip_over_https_checked_against_the_ca_bundle(https_s3):
    from conveyor.objectstore import open_object_store

    section, ca = https_s3
    store = open_object_store(parse_run_config({"object_store": {**section, "ca_bundle": str(ca)}}).object_store)
    store.put("weights/v1.bin", b"\x00weights")
    assert store.get("weights/v1.bin") == b"\x00weights"


def test_an_https_endpoint_whose_ca_is_not_trusted_is_refused(https_s3):
    from conveyor.objectstore import ObjectStoreUnavailable, open_object_store

    section, _ = https_s3
    with pytest.raises(ObjectStoreUnavailable, match="certificate verify failed"):
        open_object_store(parse_run_config({"object_store": section}).object_store)
    from urllib3.exceptions import InsecureRequestWarning

    with pytest.warns(InsecureRequestWarning):  # verify_tls: false works, and says on every request what it risks
        unchecked = open_object_store(parse_run_config({"object_store": {**section, "verify_tls": False}}).object_store)
        assert unchecked.exists("weights/none") is False
