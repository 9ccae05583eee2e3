"""A rollout worker whose engine process is killed with SIGKILL mid-run ends
with the error (the `serve` process would exit non-zero), and the tasks it
had not published are redelivered to another worker on the real broker:
every task's group is published, none lost."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import uuid

import pytest

from conveyor.contracts import Rollout, rollout_id
from conveyor.messaging import ServiceClients
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.kafka import KafkaTransport
from learner.models import create_tiny_llama
from rollout_workers.process_engine import ProcessEngine
from rollout_workers.reference_engine import ReferenceEngine
from rollout_workers.worker import RolloutWorker
from tasks.suites.pyexpr import ALPHABET, sample_problems, to_task

pytestmark = pytest.mark.chaos


async def test_engine_killed_worker_fails_and_its_tasks_are_redelivered(kafka_cfg, tmp_path):
    create_tiny_llama(tmp_path / "m", ALPHABET, seed=3, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    topics = Topics(f"ec{uuid.uuid4().hex[:6]}")
    transport = KafkaTransport(kafka_cfg)
    await transport.create_topics(topics.specs(4))
    store = LocalObjectStore(tmp_path / "objects")
    n_tasks, group = 40, 3
    problems = sample_problems(random.Random(0))
    tasks = [to_task(next(problems), topics.run_id, group, i) for i in range(n_tasks)]
    expected = {rollout_id(t.task_id, i) for t in tasks for i in range(group)}

    def worker(engine) -> RolloutWorker:
        return RolloutWorker(transport, topics, engine, store, learner_batch_samples=10_000, max_lag=0,
                             tasks_per_batch=2, max_inflight_tasks=2)  # fmt: skip

    async with ServiceClients(transport, topics.dead_letter, "test") as io:
        pub = io.publisher(topics.tasks)
        await asyncio.gather(*[await pub.publish(t, t.task_id) for t in tasks])

        doomed = ProcessEngine(tmp_path / "m", seed=0)
        first = worker(doomed)
        run = asyncio.create_task(first.run(asyncio.Event()))
        while first.generated < 2 * group and not run.done():
            await asyncio.sleep(0.01)
        os.kill(doomed._proc.pid, signal.SIGKILL)
        with pytest.raises((EOFError, OSError, RuntimeError)):
            await asyncio.wait_for(run, 60)
        assert first.generated < n_tasks * group, "the first worker finished before its engine was killed"

        second = worker(ReferenceEngine(tmp_path / "m", seed=1))
        stop = asyncio.Event()
        run2 = asyncio.create_task(second.run(stop))
        sub = await io.subscribe([topics.rollouts], "check", Rollout)
        seen: list[str] = []
        for _ in range(600):
            seen += [d.message.rollout_id for d in await sub.poll(timeout_s=0.2, max_records=1000)]
            if set(seen) >= expected or run2.done():
                break
        stop.set()
        await asyncio.wait_for(run2, 60)
    await transport.close()
    assert set(seen) == expected, f"lost {len(expected - set(seen))} rollouts"
    print(f"engine killed after {first.generated} rollouts; {len(seen) - len(expected)} regenerated under the same ids")
