"""`conveyor status` against the real broker: lag with batched producers (tansu's
ListOffsets answers short of the end for a multi-record batch; the lag must not),
and the instances alive per role from the services' heartbeats (tansu does not
answer DescribeGroups)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from conveyor.config import RunConfig
from conveyor.contracts import Task
from conveyor.messaging import ServiceClients
from conveyor.topics import Topics
from conveyor.transport.kafka import KafkaTransport
from launch.status import kafka_lag, workers_alive

pytestmark = pytest.mark.integration


async def test_lag_counts_every_record_of_batched_writes(kafka_cfg):
    run_id = f"lag{uuid.uuid4().hex[:6]}"
    topics = Topics(run_id)
    transport = KafkaTransport(kafka_cfg)
    await transport.create_topics(topics.specs(2))
    async with ServiceClients(transport, topics.dead_letter, "test") as io:
        pub = io.publisher(topics.tasks)
        # Published without waiting in between: the producer batches them.
        await asyncio.gather(*[await pub.publish(Task(task_id=f"t{i}", run_id=run_id, prompt="p"), f"t{i}") for i in range(40)])
        sub = await io.subscribe([topics.tasks], topics.group("rollout-workers"), Task)
        got = []
        while len(got) < 15:
            got += await sub.poll(timeout_s=0.5, max_records=15 - len(got))
        await sub.commit(got)
    await transport.close()
    cfg = RunConfig(run_id=run_id, transport=kafka_cfg)
    groups = await kafka_lag(cfg)
    assert groups["rollout-workers"]["lag"] == 40 - 15
    assert groups["learner"]["lag"] == 0


async def test_workers_alive_come_and_go_with_their_heartbeats(kafka_cfg, monkeypatch):
    import conveyor.messaging as messaging

    monkeypatch.setattr(messaging, "HEARTBEAT_S", 0.3)
    run_id = f"hb{uuid.uuid4().hex[:6]}"
    topics = Topics(run_id)
    transport = KafkaTransport(kafka_cfg)  # the heartbeat task creates its topic itself
    try:
        async with ServiceClients(transport, topics.dead_letter, "rollout-worker", heartbeats=topics):
            async with ServiceClients(transport, topics.dead_letter, "learner", heartbeats=topics):
                await asyncio.sleep(1.5)
                both = await workers_alive(kafka_cfg.bootstrap_servers, topics.heartbeats)
            await asyncio.sleep(1.5)  # the learner stopped beating: past three of its intervals
            one = await workers_alive(kafka_cfg.bootstrap_servers, topics.heartbeats)
    finally:
        await transport.close()
    assert both.keys() == {"rollout-worker", "learner"} and both["learner"]["alive"] == 1, both
    assert one.keys() == {"rollout-worker"}, one
