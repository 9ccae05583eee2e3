"""Claim check end to end on the in-memory transport and a local object store."""

from __future__ import annotations

import msgspec

from conveyor.contracts import (
    ClaimRef,
    DeadLetter,
    Rollout,
    VersionSegment,
    decode,
    float32_array,
    int32_array,
    rollout_id,
    uint8_array,
)
from conveyor.messaging import ClaimCheck, DeadLetterSink, Publisher, Subscriber
from conveyor.objectstore import LocalObjectStore
from conveyor.transport.memory import MemoryTransport


def big_rollout(n: int) -> Rollout:
    return Rollout(
        rollout_id=rollout_id("t", 0),
        task_id="t",
        run_id="r",
        sample_index=0,
        prompt_token_ids=int32_array(range(n)),
        completion_token_ids=int32_array(range(n)),
        behaviour_logprobs=float32_array([-1.0] * n),
        loss_mask=uint8_array([1] * n),
        version_segments=[VersionSegment(start=0, end=n, policy_version=0)],
    )


async def test_large_message_travels_as_a_reference_and_comes_back(tmp_path):
    transport = MemoryTransport(partitions=1)
    store = LocalObjectStore(tmp_path)
    cc = ClaimCheck(store, threshold_bytes=10_000)
    producer = transport.producer()
    pub = Publisher(producer, "rollouts", claim_check=cc)
    small, large = big_rollout(10), big_rollout(50_000)
    await pub.publish_and_wait(small, "t")
    await pub.publish_and_wait(large, "t")

    wire = transport.broker.topics["rollouts"][0]
    assert len(wire[1].value) < 1000, "large message was not replaced by a reference"
    ref = decode(wire[1].value, ClaimRef)
    assert ref.message_type == "rollout" and store.exists(ref.key)

    sub = Subscriber(transport, ["rollouts"], "g", Rollout, dead_letters=DeadLetterSink(producer, "dl", "t"), claim_check=cc)
    await sub.start()
    got = await sub.poll(timeout_s=1)
    assert [d.message for d in got] == [small, large]


async def test_tampered_claim_is_dead_lettered_not_delivered(tmp_path):
    transport = MemoryTransport(partitions=1)
    store = LocalObjectStore(tmp_path)
    cc = ClaimCheck(store, threshold_bytes=10_000)
    producer = transport.producer()
    await Publisher(producer, "rollouts", claim_check=cc).publish_and_wait(big_rollout(50_000), "t")
    ref = decode(transport.broker.topics["rollouts"][0][0].value, ClaimRef)
    (tmp_path / ref.key).write_bytes(b"tampered")

    sub = Subscriber(transport, ["rollouts"], "g", Rollout, dead_letters=DeadLetterSink(producer, "dl", "svc"), claim_check=cc)
    await sub.start()
    assert await sub.poll(timeout_s=0.2) == []
    letter = decode(transport.broker.topics["dl"][0][0].value, DeadLetter)
    assert "ChecksumMismatch" in letter.error
    assert msgspec.msgpack.decode(letter.raw)["key"] == ref.key


async def test_oversized_garbage_makes_a_bounded_dead_letter():
    from conveyor.messaging import DEAD_LETTER_RAW_LIMIT

    transport = MemoryTransport(partitions=1)
    producer = transport.producer()
    huge = b"\xc1" + b"x" * (6 << 20)  # not msgpack, and far larger than a dead letter may be
    await producer.send_and_wait("rollouts", huge, b"k")
    await Publisher(producer, "rollouts").publish_and_wait(big_rollout(5), "t")
    sub = Subscriber(transport, ["rollouts"], "g", Rollout, dead_letters=DeadLetterSink(producer, "dl", "svc"))
    await sub.start()
    got = await sub.poll(timeout_s=0.2)
    assert [d.message.rollout_id for d in got] == [big_rollout(5).rollout_id]  # the next record is still delivered
    letter = decode(transport.broker.topics["dl"][0][0].value, DeadLetter)
    assert letter.raw_truncated and letter.raw_size == len(huge) and len(letter.raw) == DEAD_LETTER_RAW_LIMIT
    assert (letter.source_topic, letter.source_offset) == ("rollouts", 0)


async def test_services_built_from_a_run_config_claim_check_what_is_too_large(tmp_path):
    """The run config's ``claim_check:`` reaches the services their build() makes: a rollout worker
    publishes rollouts above the threshold by reference, and the bridge reads them back."""
    import asyncio
    import random

    from conveyor.config import parse_run_config
    from conveyor.contracts import ScoredRollout, decode_or_claim
    from conveyor.messaging import ServiceClients
    from conveyor.topics import Topics
    from learner.models import create_tiny_llama
    from reward import build as reward_build
    from reward.scorers import LocalScorer
    from rollout_workers import build as worker_build
    from rollout_workers.reference_engine import ReferenceEngine
    from tasks.suites.pyexpr import ALPHABET, sample_problems, to_task
    from tests.conftest import open_sandbox

    create_tiny_llama(tmp_path / "m", ALPHABET, seed=0, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    cfg = parse_run_config({"run_id": "cc", "claim_check": {"threshold_bytes": 1024}}, "test")
    topics = Topics("cc")
    transport = MemoryTransport(partitions=1)
    await transport.create_topics(topics.specs(1))
    store = LocalObjectStore(tmp_path / "o")
    engine = ReferenceEngine(tmp_path / "m", seed=0)
    worker = worker_build.build(cfg, transport, topics, store, engine=engine)
    bridge = reward_build.build(cfg, transport, topics, scorer=LocalScorer(open_sandbox()), decode=engine.decode, store=store)
    long_prompt = msgspec.structs.replace(
        to_task(next(sample_problems(random.Random(0))), "cc", 2, 0), metadata={"pad": "x" * 2000}
    )
    async with ServiceClients(transport, topics.dead_letter, "test", claim_check=ClaimCheck(store, 1024)) as io:
        await (await io.publisher(topics.tasks).publish(long_prompt, "t"))
        stop = asyncio.Event()
        runs = [asyncio.create_task(s.run(stop)) for s in (worker, bridge)]
        for _ in range(400):
            if bridge.scored >= 2:
                break
            await asyncio.sleep(0.025)
        stop.set()
        await asyncio.gather(*runs)
        reader = transport.consumer([topics.rollouts], "raw")
        await reader.start()
        raw = [r.value for r in await reader.getmany(0.5, 100)]
        scored = await (await io.subscribe([topics.scored], "check", ScoredRollout)).poll(0.5, 100)
    assert (worker.generated, bridge.scored, worker.tasks_refused) == (2, 2, 0)
    assert len(raw) == 2 and all(type(decode_or_claim(v, Rollout)) is ClaimRef for v in raw)  # by reference
    assert len(scored) == 2 and all(s.message.rollout.task.metadata["pad"] == "x" * 2000 for s in scored)
