"""Shared fixtures.

Services come from the project's own stack code (``launch.stack``). In CI
(``CI`` set) a service that cannot start fails the test; on a laptop the
test is skipped and says why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch.stack.manager import free_port_block  # noqa: F401 - re-exported for tests

ROOT = Path(__file__).resolve().parent.parent
IN_CI = bool(os.environ.get("CI"))


# The suite runs on parallel workers (README's test command: pytest-xdist, `-n 4`). Most of an
# integration test's time is spent waiting on services, which is why more workers than cores
# pay off; the modules that train or serve models for minutes are the exception. Those run in
# two lanes, each lane one worker's queue, one module after another, so that at most two of them
# compete for the two cores and their learning runs keep the pace their margins were set at.
# Every other module is a group of its own (its module-scoped fixtures start once) and goes to
# whichever worker is free. The lanes are handed out first, the longest modules first in each,
# then the unit tier's small modules (a worker holds its next group while it runs one: behind a
# lane that should be a short one).
CPU_LANES = {
    "cpu-lane-a": (
        "integration/test_your_model_your_data.py",
        "integration/test_distributed_learning.py",
        "integration/test_vision_demo.py",
        "integration/test_learner_ranks.py",
        "integration/test_context_parallel.py",
    ),
    "cpu-lane-b": (
        "integration/test_vllm_engine.py",
        "chaos/test_distributed_chaos.py",
        "chaos/test_learner_resume.py",
        "integration/test_demo.py",
    ),
}
LANE_OF = {path: (lane, i) for lane, paths in CPU_LANES.items() for i, path in enumerate(paths)}


def pytest_configure(config):
    """On a parallel worker, one OpenMP thread per process (its children inherit it: the roles,
    torchrun's ranks, the CLI): with every core busy, torch's intra-op threads wait on each other
    at every op, and a 2-thread training loop beside three other workers ran ten times slower."""
    if hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    def place(item) -> tuple[int, int]:
        path = Path(str(item.fspath)).relative_to(ROOT / "tests").as_posix()
        lane, order = LANE_OF.get(path, (path, 0))
        item.add_marker(pytest.mark.xdist_group(lane))
        tier = path.split("/")[0]
        if tier in ("unit", "integration", "chaos"):
            item.add_marker(getattr(pytest.mark, tier))
        return (0 if lane in CPU_LANES else 1 if tier == "unit" else 2, order)

    items.sort(key=place)  # stable: within a module, and for every other module, the collection order


def service_unavailable(reason: str):
    """Fail in CI, skip elsewhere."""
    if IN_CI:
        pytest.fail(f"required service unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"service unavailable (would fail in CI): {reason}")


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """Kafka-protocol broker and S3 server from the local stack, for the whole session."""
    from launch.stack.components import BinaryMissing
    from launch.stack.manager import Stack, StackError, StackPorts

    st = Stack(tmp_path_factory.mktemp("stack"), StackPorts.from_base(free_port_block()))
    try:
        st.up(["kafka", "s3"], timeout_s=90)
    except (StackError, BinaryMissing) as exc:
        service_unavailable(f"local stack did not start: {exc}")
    yield st
    st.down(grace_s=3)


@pytest.fixture(autouse=True)
def stack_serving_after_chaos(request):
    """After a chaos test that used the session stack, restart any of its servers that does not answer.

    A chaos test that fails between a kill and its restart would otherwise
    leave the broker or S3 down for every test after it, and one failure
    would read as twenty.
    """
    yield
    if request.node.get_closest_marker("chaos") is None or "stack" not in request.fixturenames:
        return
    stack = request.getfixturevalue("stack")
    restarted = [name for name in stack.read_state() if stack.ensure_healthy(name)]
    if restarted:
        print(f"restarted after {request.node.name}: {', '.join(restarted)}")


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
    from launch.stack.components import LOCAL_S3_ACCESS_KEY, LOCAL_S3_SECRET_KEY

    return S3StoreConfig(
        endpoint_url=stack.endpoints()["s3"],
        bucket="conveyor-test",
        access_key_id=LOCAL_S3_ACCESS_KEY,
        secret_access_key=LOCAL_S3_SECRET_KEY,
        max_attempts=3,
    )


def local_redis(directory, **stack_kw):
    """Start the local stack's Redis-protocol server (valkey) in ``directory``; yields its URL
    (``stack_kw``: e.g. ``redis_users`` for a password and ACL users)."""
    from launch.stack.components import BinaryMissing
    from launch.stack.manager import Stack, StackError, StackPorts

    st = Stack(directory, StackPorts.from_base(free_port_block()), **stack_kw)
    try:
        st.up(["redis"], timeout_s=30)
    except (StackError, BinaryMissing) as exc:
        service_unavailable(f"local stack redis did not start: {exc}")
    yield st.endpoints()["redis"]
    st.down(grace_s=3)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A Redis-protocol server (valkey) from the local stack, for Celery tests."""
    yield from local_redis(tmp_path_factory.mktemp("redis-stack"))


def make_rollout_for(task, completion: str, sample_index: int = 0):
    """A Rollout whose completion decodes (one token per byte) to ``completion``."""
    from conveyor.contracts import Rollout, VersionSegment, float32_array, int32_array, rollout_id, uint8_array

    ids = list(completion.encode())
    return Rollout(
        rollout_id=rollout_id(task.task_id, sample_index),
        task_id=task.task_id,
        run_id=task.run_id,
        sample_index=sample_index,
        group_size=task.group_size,
        prompt_token_ids=int32_array([1, 2]),
        completion_token_ids=int32_array(ids),
        behaviour_logprobs=float32_array([-0.1] * len(ids)),
        loss_mask=uint8_array([1] * len(ids)),
        version_segments=[VersionSegment(start=0, end=len(ids), policy_version=0)],
        task=task,
    )


def decode_bytes(ids) -> str:
    return bytes(ids).decode()


def open_sandbox(*, parallel: int | None = None, warm: bool = False, **limits):
    """A reward sandbox with these limits; where bubblewrap cannot run: fail in CI, skip elsewhere."""
    from sandbox.runner import Sandbox, SandboxLimits, SandboxUnavailable

    try:
        return Sandbox(SandboxLimits(**limits), parallel=parallel, warm=warm)
    except SandboxUnavailable as exc:
        service_unavailable(f"bubblewrap sandbox: {exc}")


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """The same tests against a local directory and the stack's SeaweedFS (a fresh key prefix each)."""
    import uuid

    from conveyor.objectstore import LocalObjectStore, S3ObjectStore

    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    cfg = request.getfixturevalue("s3_cfg")
    return S3ObjectStore(cfg.model_copy(update={"prefix": f"test-{uuid.uuid4().hex[:8]}/"}))


def start_prometheus(data_dir, port: int, targets: dict[str, int], rule_files=(), labels=None):
    """A Prometheus server (Debian's package, installed by install.sh) scraping ``targets`` (role name ->
    metrics port) every second; fails in CI, skips elsewhere, when it cannot start."""
    from launch.stack.components import BinaryMissing
    from launch.stack.prometheus import Prometheus

    try:
        return Prometheus(data_dir, port, targets, rule_files, labels=labels or {}).start()
    except (BinaryMissing, RuntimeError) as exc:
        service_unavailable(f"prometheus did not start: {exc}")
