"""Connect to every backend a run config names, with a real request each.

``conveyor config validate FILE --connect`` uses this before a run starts,
so a wrong address fails at start with the section named, not an hour in.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config import RunConfig


@dataclass(frozen=True)
class ProbeResult:
    section: str
    target: str
    ok: bool
    detail: str


def probe_transport(cfg: RunConfig, timeout_s: float = 5.0) -> ProbeResult:
    if cfg.transport.type == "memory":
        return ProbeResult("transport", "in-process", True, "memory transport needs no broker")
    from launch.stack.manager import check_kafka

    target = cfg.transport.bootstrap_servers
    try:
        check_kafka(target, timeout_s)
    except Exception as exc:  # noqa: BLE001
        return ProbeResult("transport", target, False, f"{type(exc).__name__}: {exc}")
    return ProbeResult("transport", target, True, "metadata request answered")


def probe_object_store(cfg: RunConfig) -> ProbeResult:
    from conveyor.objectstore import open_object_store

    store_cfg = cfg.object_store
    target = str(store_cfg.root) if store_cfg.type == "local" else f"{store_cfg.endpoint_url or 'AWS'} bucket {store_cfg.bucket}"
    if store_cfg.type == "s3":
        store_cfg = store_cfg.model_copy(update={"max_attempts": 1, "connect_timeout_s": 3.0, "read_timeout_s": 5.0})
    try:
        store = open_object_store(store_cfg)
        list(zip(range(1), store.list("")))
    except Exception as exc:  # noqa: BLE001
        return ProbeResult("object_store", target, False, f"{type(exc).__name__}: {exc}")
    return ProbeResult("object_store", target, True, "listing answered")


def probe_celery_broker(cfg: RunConfig, timeout_s: float = 5.0) -> ProbeResult:
    broker = cfg.celery
    if broker.type == "local":
        return ProbeResult("celery", "local process pool", True, "no broker needed")
    from reward.celery_app import make_app

    try:
        # The reward service's own connection: its password and TLS settings, not the bare URL.
        app = make_app(cfg)
        with app.connection_for_write() as conn:
            conn.connect_timeout = timeout_s
            conn.ensure_connection(max_retries=1, timeout=timeout_s)
            info = conn.transport.driver_name
        app.close()
    except Exception as exc:  # noqa: BLE001
        return ProbeResult("celery", _redact(broker.url), False, f"{type(exc).__name__}: {exc}")
    return ProbeResult("celery", _redact(broker.url), True, f"connected ({info})")


def _redact(url: str) -> str:
    from kombu.utils.url import maybe_sanitize_url

    return maybe_sanitize_url(url)


def probe_all(cfg: RunConfig) -> list[ProbeResult]:
    return [probe_transport(cfg), probe_object_store(cfg), probe_celery_broker(cfg)]
