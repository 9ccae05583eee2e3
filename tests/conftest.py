"""Shared fixtures.

Services come from the project's own stack code (``conveyor.stack``). In CI
(``CI`` set) a service that cannot start fails the test; on a laptop the
test is skipped and says why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conveyor.stack.manager import free_port_block  # noqa: F401 - re-exported for tests

ROOT = Path(__file__).resolve().parent.parent
IN_CI = bool(os.environ.get("CI"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.fspath)).relative_to(ROOT / "tests").parts[0]
        if tier in ("unit", "integration", "chaos"):
            item.add_marker(getattr(pytest.mark, tier))


def service_unavailable(reason: str):
    """Fail in CI, skip elsewhere."""
    if IN_CI:
        pytest.fail(f"required service unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"service unavailable (would fail in CI): {reason}")


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """Kafka-protocol broker and S3 server from the local stack, for the whole session."""
    from conveyor.stack.components import BinaryMissing
    from conveyor.stack.manager import Stack, StackError, StackPorts

    st = Stack(tmp_path_factory.mktemp("stack"), StackPorts.from_base(free_port_block()))
    try:
        st.up(["kafka", "s3"], timeout_s=90)
    except (StackError, BinaryMissing) as exc:
        service_unavailable(f"local stack did not start: {exc}")
    yield st
    st.down(grace_s=3)


@pytest.fixture
def kafka_cfg(stack):
    from conveyor.config import KafkaTransportConfig

    return KafkaTransportConfig(
        bootstrap_servers=stack.endpoints()["kafka"],
        partitions=4,
        connect_deadline_s=20,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
    )


@pytest.fixture
def s3_cfg(stack):
    from conveyor.config import S3StoreConfig
    from conveyor.stack.components import LOCAL_S3_ACCESS_KEY, LOCAL_S3_SECRET_KEY

    return S3StoreConfig(
        endpoint_url=stack.endpoints()["s3"],
        bucket="conveyor-test",
        access_key_id=LOCAL_S3_ACCESS_KEY,
        secret_access_key=LOCAL_S3_SECRET_KEY,
        max_attempts=3,
    )
