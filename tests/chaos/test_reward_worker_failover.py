"""kill -9 a Celery reward worker in the middle of a task (Redis and RabbitMQ):
the task runs again on another worker and exactly one ScoredRollout appears."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from celery_support import Worker, write_config
from conftest import decode_bytes, make_rollout_for

from conveyor.contracts import ScoredRollout, Task, VerifierSpec, decode


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_task_survives_a_killed_worker(broker, redis_url, tmp_path):
    from conveyor.config import load_run_config
    from conveyor.messaging import Publisher
    from conveyor.topics import Topics
    from conveyor.transport.memory import MemoryBroker, MemoryTransport
    from reward.bridge import RewardBridge
    from reward.celery_app import make_app
    from reward.scorers import CeleryScorer

    queue = f"chaos-{broker}-{uuid.uuid4().hex[:6]}"
    path = write_config(tmp_path / "run.yaml", broker, redis_url, queue)
    app = make_app(load_run_config(path))
    task = Task(task_id=f"slow-{uuid.uuid4().hex[:8]}", run_id="chaos", prompt="p", group_size=1,
                verifier=VerifierSpec(kind="python_tests", data={"tests": "assert f() == 1\n"}))  # fmt: skip
    rollout = make_rollout_for(task, "import time\ntime.sleep(3)\n\ndef f():\n    return 1\n")
    received = f"Task conveyor.reward.score[{rollout.rollout_id}] received"

    async def scenario():
        transport = MemoryTransport(MemoryBroker(), partitions=1)
        topics = Topics("chaos")
        await transport.create_topics(topics.specs(1))
        producer = transport.producer()
        await producer.start()
        await Publisher(producer, topics.rollouts).publish_and_wait(rollout, rollout.task_id)
        first = Worker(path, f"first-{broker}", tmp_path)
        second = None
        try:
            await asyncio.to_thread(first.wait_for, "ready")
            stop = asyncio.Event()
            stop.set()  # drain: return once the rollout is scored and nothing more waits
            bridge = RewardBridge(transport, topics, CeleryScorer(app, result_timeout_s=120), decode_bytes)
            run = asyncio.create_task(bridge.run(stop))
            await asyncio.to_thread(first.wait_for, received)
            await asyncio.sleep(1.0)  # the program is sleeping inside the sandbox now
            first.kill9()
            killed_at = time.monotonic()
            second = Worker(path, f"second-{broker}", tmp_path)
            await asyncio.wait_for(run, timeout=150)
            redelivered_after = time.monotonic() - killed_at
        finally:
            first.stop()
            if second is not None:
                second.stop()
        sub = transport.consumer([topics.scored], "check")
        await sub.start()
        records = []
        for _ in range(10):
            records += await sub.getmany(timeout_s=0.1)
        return [decode(r.value, ScoredRollout) for r in records], second, redelivered_after

    scored, second, redelivered_after = asyncio.run(scenario())
    assert [(s.rollout_id, s.verdict, s.reward) for s in scored] == [(rollout.rollout_id, "pass", 1.0)]
    assert received in second.log.read_text()  # it ran again, on the other worker
    print(f"{broker}: result {redelivered_after:.1f} s after the kill")
