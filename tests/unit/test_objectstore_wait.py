"""A service starting while its object store is unreachable waits for it, up to
``connect_deadline_s``, then fails with the store's error; other errors fail at once.
(The S3 outage during start-up, with the real server, is in tests/chaos/test_lake_sink.py.)"""

from __future__ import annotations

import asyncio
import socket

import pytest
import structlog

from conveyor.config import LocalStoreConfig, S3StoreConfig
from conveyor.objectstore import LocalObjectStore, ObjectStoreUnavailable, wait_for_object_store


def _refusing_endpoint() -> str:
    with socket.socket() as s:  # a port nothing listens on (the kernel gave it and we closed it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_unreachable_s3_is_retried_until_the_deadline_then_raises():
    cfg = S3StoreConfig(endpoint_url=_refusing_endpoint(), access_key_id="k", secret_access_key="s", max_attempts=1,
                        connect_timeout_s=0.5, connect_deadline_s=4.0)  # fmt: skip
    with structlog.testing.capture_logs() as logs, pytest.raises(ObjectStoreUnavailable):
        asyncio.run(wait_for_object_store(cfg, first_delay_s=0.2, max_delay_s=0.4))
    waits = [e for e in logs if e["event"] == "object_store.waiting"]
    assert len(waits) >= 2, logs  # retried, with backoff, then gave up at the deadline
    assert [w["attempt"] for w in waits] == list(range(1, len(waits) + 1))
    assert [w["delay_s"] for w in waits][:3] == [0.2, 0.4, 0.4][: len(waits)]


def test_errors_that_waiting_cannot_mend_fail_at_once():
    cfg = S3StoreConfig(endpoint_url="not-a-url", access_key_id="k", secret_access_key="s", connect_deadline_s=60)
    with structlog.testing.capture_logs() as logs, pytest.raises(ValueError):
        asyncio.run(wait_for_object_store(cfg))
    assert not [e for e in logs if e["event"] == "object_store.waiting"]


def test_a_local_store_opens_at_once(tmp_path):
    store = asyncio.run(wait_for_object_store(LocalStoreConfig(root=tmp_path / "objects")))
    assert isinstance(store, LocalObjectStore)
