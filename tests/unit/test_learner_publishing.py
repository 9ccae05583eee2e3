"""The learner publishes weights every ``publish_every`` steps and at a clean stop, announces
each version on the weights topic, and keeps only the newest ``keep_versions`` in the store."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.contracts import WeightsAnnouncement, decode
from conveyor.messaging import Publisher
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from learner.recipe import GRPOLearner
from scored_factory import scored_group
from storage.objectstore import LocalObjectStore


async def test_publishes_every_k_steps_and_the_final_policy(tmp_path):
    from learner.models import create_tiny_llama
    from producers.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    transport, topics = MemoryTransport(), Topics("pub")
    await transport.create_topics(topics.specs(1))
    store = LocalObjectStore(tmp_path / "objects")
    learner = GRPOLearner(transport, topics, model, tok.pad_token_id, store, run_dir=tmp_path, batch_groups=1, max_lag=100,
                          publish_every=2, keep_versions=2)  # fmt: skip
    producer = transport.producer()
    await producer.start()
    pub = Publisher(producer, topics.scored)
    for g in range(5):  # five steps of one group each
        for r in scored_group("pub", g, 2):
            await (await pub.publish(r, r.rollout.task_id))
    stop = asyncio.Event()
    run = asyncio.create_task(learner.run(stop))
    for _ in range(600):
        if learner.step >= 5:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(run, 60)
    announced = []
    sub = transport.consumer([topics.weights], "check")
    await sub.start()
    for rec in await sub.getmany(timeout_s=0.5, max_records=100):
        announced.append(decode(rec.value, WeightsAnnouncement).version)
    await sub.close()
    await producer.close()
    assert learner.step == 5
    assert announced == [2, 4, 5]  # every second step, then the final policy at the stop
    assert learner._published_versions() == [4, 5]  # keep_versions=2


def test_a_lag_that_would_drop_every_sample_is_refused():
    from conveyor.config import parse_run_config
    from conveyor.errors import ConfigError

    with pytest.raises(ConfigError, match="max_lag"):
        parse_run_config({"learner": {"publish_every": 4, "max_lag": 2}}, "run.yaml")
    parse_run_config({"learner": {"publish_every": 4, "max_lag": 3}}, "run.yaml")
