"""A batch that trains nothing is not a new policy version, and the progress topic counts each
rollout once: what the rollout workers' admission tickets are compared against."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from scored_factory import scored_group

from conveyor.config import LearnerConfig
from conveyor.contracts import LearnerProgress, WeightsAnnouncement, decode
from conveyor.messaging import Publisher
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from learner.recipe import GRPOLearner

pytestmark = pytest.mark.unit


def _flat(run_id: str, g: int) -> list:
    """Group ``g`` with every reward 1.0: zero variance, nothing to learn from."""
    return [msgspec.structs.replace(s, reward=1.0, verdict="pass") for s in scored_group(run_id, g, 2)]


async def _run(tmp_path, groups: list[list], *, wait_for_consumed: int):
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    transport, topics = MemoryTransport(), Topics("ver")
    await transport.create_topics(topics.specs(1))
    cfg = LearnerConfig(batch_groups=1, max_lag=100, lr=3e-4, checkpoint_every=0)
    learner = GRPOLearner(
        transport, topics, model, tok.pad_token_id, LocalObjectStore(tmp_path / "objects"), cfg, run_dir=tmp_path
    )
    producer = transport.producer()
    await producer.start()
    pub = Publisher(producer, topics.scored)
    for group in groups:
        for s in group:
            await (await pub.publish(s, s.rollout.task_id))
    stop = asyncio.Event()
    run = asyncio.create_task(learner.run(stop))
    for _ in range(600):
        if learner.samples_consumed >= wait_for_consumed:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.2)  # a report of consumption without a step follows within a second
    stop.set()
    await asyncio.wait_for(run, 60)
    await producer.close()

    async def read(topic, typ):
        c = transport.consumer([topic], "check")
        await c.start()
        out = [decode(r.value, typ) for r in await c.getmany(timeout_s=0.5, max_records=1000)]
        await c.close()
        return out

    return learner, await read(topics.weights, WeightsAnnouncement), await read(topics.progress, LearnerProgress)


async def test_a_batch_with_nothing_to_train_publishes_no_version(tmp_path):
    groups = [scored_group("ver", 0, 2), _flat("ver", 1), _flat("ver", 2), scored_group("ver", 3, 2)]
    learner, announced, progress = await _run(tmp_path, groups, wait_for_consumed=8)
    assert learner.step == 2 and learner.version == 2  # two batches trained; two were flat
    assert [a.version for a in announced] == [1, 2]
    assert learner.counters["batches_untrained"] == 2 and learner.counters["samples_zero_variance"] == 4
    assert progress[-1].samples_consumed == 8 and progress[-1].policy_version == 2
    # Every version the learner reported came with the weights announced before it.
    assert {p.policy_version for p in progress} <= {0, *(a.version for a in announced)}


async def test_a_redelivered_rollout_is_skipped_without_counting_it_consumed(tmp_path):
    first = scored_group("ver", 0, 2)
    again = scored_group("ver", 0, 2)  # the same rollout ids, delivered again (a bridge replayed them)
    learner, _, progress = await _run(tmp_path, [first, again, scored_group("ver", 1, 2)], wait_for_consumed=4)
    assert learner.counters["duplicates_skipped"] == 2
    assert progress[-1].samples_consumed == 4  # the learner's count matches the ledger's: once per rollout
