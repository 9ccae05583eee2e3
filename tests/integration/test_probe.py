"""`config validate --connect` against real backends: the stack's broker and
S3, and both Celery brokers the machine runs (Redis 6379, RabbitMQ 5672)."""

from __future__ import annotations

import socket

import pytest
from conftest import service_unavailable

from conveyor.config import parse_run_config
from launch.probe import probe_all


def reachable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize(
    "celery, port",
    [
        ({"type": "redis", "url": "redis://127.0.0.1:6379/0"}, 6379),
        ({"type": "rabbitmq", "url": "amqp://guest:guest@127.0.0.1:5672//"}, 5672),
    ],
    ids=["redis", "rabbitmq"],
)
def test_every_backend_answers(kafka_cfg, s3_cfg, celery, port):
    if not reachable(port):
        service_unavailable(f"the machine's {celery['type']} on port {port} is not running")
    cfg = parse_run_config(
        {
            "run_id": "probe",
            "transport": kafka_cfg.model_dump(),
            "object_store": {**s3_cfg.model_dump(), "secret_access_key": s3_cfg.secret_access_key.get_secret_value()},
            "celery": celery,
        }
    )
    results = probe_all(cfg)
    assert [r.section for r in results] == ["transport", "object_store", "celery"]
    assert all(r.ok for r in results), results


def test_unreachable_backends_are_reported_by_section(tmp_path):
    from launch.stack.manager import free_port_block

    dead = free_port_block(3)
    cfg = parse_run_config(
        {
            "run_id": "probe",
            "transport": {"type": "kafka", "bootstrap_servers": f"127.0.0.1:{dead}"},
            "object_store": {
                "type": "s3",
                "endpoint_url": f"http://127.0.0.1:{dead + 1}",
                "access_key_id": "a",
                "secret_access_key": "b",
            },
            "celery": {"type": "redis", "url": f"redis://127.0.0.1:{dead + 2}/0"},
        }
    )
    results = probe_all(cfg)
    assert [r.ok for r in results] == [False, False, False]
    assert str(dead) in results[0].target and str(dead + 2) in results[2].target
