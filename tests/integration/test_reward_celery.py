"""Reward scoring through Celery workers (real processes) on Redis and RabbitMQ,
and the bridge publishing exactly one ScoredRollout per rollout."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from celery_support import Worker, write_config
from conftest import decode_bytes, make_rollout_for

from conveyor.contracts import ScoredRollout, Task, VerifierSpec


def T(task_id, kind, prompt="p", **data):
    return Task(task_id=task_id, run_id="celery-it", prompt=prompt, group_size=2, verifier=VerifierSpec(kind=kind, data=data))


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def celery_run(request, redis_url, tmp_path_factory):
    from conveyor.config import load_run_config
    from reward.celery_app import make_app

    tmp = tmp_path_factory.mktemp(f"celery-{request.param}")
    queue = f"it-{request.param}-{uuid.uuid4().hex[:6]}"
    # Spans to the worker's stdout (its log), every trace sampled: the trace test reads them there.
    path = write_config(tmp / "run.yaml", request.param, redis_url, queue, tracing={"exporter": "console", "sample_ratio": 1.0})
    worker = Worker(path, f"w-{request.param}", tmp)
    try:
        worker.wait_for("ready")
        app = make_app(load_run_config(path))
        yield app, load_run_config(path), worker
    finally:
        worker.stop()


def test_status_counts_the_workers_on_the_runs_queue(celery_run):
    from launch.status import reward_workers_alive

    _, cfg, _ = celery_run
    alive = reward_workers_alive(cfg, timeout_s=2.0)
    assert alive["alive"] == 1 and alive["instances"][0].startswith("w-"), alive
    other = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"queue": "nobody-consumes-this"})})
    assert reward_workers_alive(other, timeout_s=1.0)["alive"] == 0


def test_scores_every_verifier_kind(celery_run):
    from reward.scorers import CeleryScorer

    app, _, _ = celery_run
    scorer = CeleryScorer(app, result_timeout_s=60)
    items = [
        (T("a", "math", answer="2"), r"\boxed{2}", f"a-{uuid.uuid4().hex}"),
        (T("b", "python_tests", tests="assert f() == 1\n"), "def f():\n    return 1\n", f"b-{uuid.uuid4().hex}"),
        (T("c", "python_tests", tests="assert f() == 1\n"), "def f():\n    return [][1]\n", f"c-{uuid.uuid4().hex}"),
        (T("d", "python_program", prompt="x = 1\n"), "while True: pass\n", f"d-{uuid.uuid4().hex}"),
        (None, "x", f"e-{uuid.uuid4().hex}"),
    ]
    got = [(v.reward, v.verdict) for v in asyncio.run(scorer.score(items))]
    assert got == [(1.0, "pass"), (1.0, "pass"), (0.0, "fail"), (0.0, "timeout"), (0.0, "error")]


def test_results_are_read_without_subscribing_and_forgotten_after_collection(celery_run):
    """The scorer reads results by MGET from one collector thread: nothing subscribes to Redis's
    result channels (Celery buffers messages of results resolved already and never drops them:
    the reward bridge grew 21 MiB over a 30-minute load run), and each result's key is deleted
    once it was collected."""
    from reward.scorers import CeleryScorer

    app, _, _ = celery_run
    scorer = CeleryScorer(app, result_timeout_s=60)
    ids = []
    for b in range(4):
        items = [(T(f"m{b}-{i}", "math", answer=str(i)), rf"\boxed{{{i}}}", f"m-{uuid.uuid4().hex}") for i in range(48)]
        ids += [rid for _, _, rid in items]
        assert {v.verdict for v in asyncio.run(scorer.score(items))} == {"pass"}
    backend = scorer.backend  # the collector thread's: Celery keeps a backend per thread
    assert backend is not None
    if hasattr(backend, "get_key_for_task"):  # a key-value result backend (Redis)
        assert not backend.result_consumer.subscribed_to and backend.result_consumer._pubsub is None
        assert not any(backend.client.exists(backend.get_key_for_task(rid)) for rid in ids)
    else:  # rpc:// (RabbitMQ): results arrive as messages, each taken once
        assert scorer.in_flight == 0


async def _bridge_once(app, rollouts, deliveries_of_first: int = 2):
    from conveyor.messaging import Publisher
    from conveyor.topics import Topics
    from conveyor.transport.memory import MemoryBroker, MemoryTransport
    from reward.bridge import RewardBridge
    from reward.scorers import CeleryScorer

    transport = MemoryTransport(MemoryBroker(), partitions=2)
    topics = Topics("celery-it")
    await transport.create_topics(topics.specs(2))
    producer = transport.producer()
    await producer.start()
    pub = Publisher(producer, topics.rollouts)
    for r in rollouts + [rollouts[0]] * (deliveries_of_first - 1):  # the first one is delivered twice
        await pub.publish_and_wait(r, r.task_id)
    bridge = RewardBridge(transport, topics, CeleryScorer(app, result_timeout_s=90), decode_bytes)
    stop = asyncio.Event()
    stop.set()  # drain what is there, then return
    await bridge.run(stop)
    sub = transport.consumer([topics.scored], "check")
    await sub.start()
    records = []
    for _ in range(10):
        records += await sub.getmany(timeout_s=0.1)
    await producer.close()
    from conveyor.contracts import decode

    return [decode(rec.value, ScoredRollout) for rec in records]


def test_bridge_publishes_one_scored_rollout_per_rollout(celery_run):
    app, _, _ = celery_run
    task = T(f"g-{uuid.uuid4().hex[:8]}", "python_tests", tests="assert f() == 3\n")
    rollouts = [make_rollout_for(task, "def f():\n    return 3\n", 0), make_rollout_for(task, "def f():\n    return 4\n", 1)]
    scored = asyncio.run(_bridge_once(app, rollouts))
    assert sorted((s.rollout_id, s.verdict) for s in scored) == sorted(
        [(rollouts[0].rollout_id, "pass"), (rollouts[1].rollout_id, "fail")]
    )


def test_a_rollouts_trace_goes_on_in_the_worker_through_the_task_headers(celery_run):
    from reward.scorers import CeleryScorer

    app, _, worker = celery_run
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]  # the bridge's score span
    rid = f"t-{uuid.uuid4().hex}"
    scorer = CeleryScorer(app, result_timeout_s=60)

    async def score():
        return await asyncio.gather(*scorer.submit([(T("t", "python_tests", tests="assert f() == 1\n"), "def f():\n    return 1\n", rid)],
                                                   trace={rid: {"traceparent": f"00-{trace_id}-{parent_id}-01"}}))  # fmt: skip

    [v] = asyncio.run(score())
    assert v.verdict == "pass"
    worker.wait_for(f'"trace_id": "0x{trace_id}"', timeout_s=30)  # the worker's verify span, in the same trace
    span = worker.log.read_text().split(f'"trace_id": "0x{trace_id}"')[0].rsplit('"name": ', 1)[1]
    assert span.startswith('"verify"') and f'"parent_id": "0x{parent_id}"' in worker.log.read_text()
    # and the task's log line carries the trace id (a log search finds the trace, and back)
    scored = [line for line in worker.log.read_text().splitlines() if '"event": "scored"' in line and rid in line]
    assert scored and f'"trace_id": "{trace_id}"' in scored[0], scored


def test_batched_rollouts_keep_their_own_traces(celery_run):
    """Rollouts scored in the worker's process travel together in one task; each one's verify span
    is still a child of its own score span."""
    from reward.scorers import CeleryScorer

    app, _, worker = celery_run
    scorer = CeleryScorer(app, result_timeout_s=60)
    traces = {f"b-{uuid.uuid4().hex}": (uuid.uuid4().hex, uuid.uuid4().hex[:16]) for _ in range(3)}
    items = [(T(f"b{i}", "math", answer=str(i)), rf"\boxed{{{i}}}", rid) for i, rid in enumerate(traces)]

    async def score():
        return await asyncio.gather(
            *scorer.submit(items, trace={rid: {"traceparent": f"00-{t}-{p}-01"} for rid, (t, p) in traces.items()})
        )

    assert [v.verdict for v in asyncio.run(score())] == ["pass"] * 3
    assert scorer.tasks_sent == 1
    for trace_id, parent_id in traces.values():
        worker.wait_for(f'"trace_id": "0x{trace_id}"', timeout_s=30)
        span = worker.log.read_text().split(f'"trace_id": "0x{trace_id}"')[1].split('"parent_id": ', 1)[1]
        assert span.startswith(f'"0x{parent_id}"')


def test_a_verifier_kind_goes_to_its_own_queue(redis_url, tmp_path):
    """reward.queues sends a kind's tasks to a queue of their own; a worker started with --queue
    consumes it (no worker consumes the default queue here: a task sent there would not return)."""
    from conveyor.config import load_run_config
    from reward.build import scorer

    queue = f"it-own-{uuid.uuid4().hex[:6]}"
    path = write_config(tmp_path / "run.yaml", "redis", redis_url, queue, queues={"math": f"{queue}-math"}, result_timeout_s=30)
    worker = Worker(path, "w-math", tmp_path, queue=f"{queue}-math")
    try:
        worker.wait_for("ready")
        s = scorer(load_run_config(path))
        try:
            [v] = asyncio.run(s.score([(T("m", "math", answer="3"), r"\boxed{3}", f"m-{uuid.uuid4().hex}")]))
        finally:
            s.close()
        assert (v.reward, v.verdict) == (1.0, "pass")
    finally:
        worker.stop()
