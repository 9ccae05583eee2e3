"""Poison on every topic of a running pipeline, on the real Kafka-protocol broker and S3 server:
each record is dead-lettered (or refused and answered) by every consumer that reads it, no
service stops, and every good task is still generated, scored, trained on and stored.

Prints ``FIGURE poison_deadlettered <n>/<m>``: poison records with a dead letter, of all sent."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from conveyor.config import LearnerConfig, SinkConfig
from conveyor.contracts import (
    DeadLetter,
    Heartbeat,
    SamplingParams,
    ScoredRollout,
    decode,
    encode,
)
from conveyor.messaging import ServiceClients
from conveyor.objectstore import open_object_store
from conveyor.topics import Topics
from conveyor.transport import open_transport
from learner.models import create_tiny_llama
from learner.recipe import GRPOLearner
from reward.bridge import RewardBridge
from reward.scorers import LocalScorer
from rollout_workers.reference_engine import ReferenceEngine
from rollout_workers.worker import RolloutWorker
from storage.lake import LakeReader
from storage.sink import StorageSink
from tasks.suites.pyexpr import ALPHABET, sample_problems, to_task
from tests.conftest import make_rollout_for, open_sandbox

pytestmark = pytest.mark.integration

GROUP = 4


def _nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


def _with(msg, **fields) -> bytes:
    """``msg`` encoded, with top-level fields replaced by values its type would never encode."""
    return msgspec.msgpack.encode({**msgspec.msgpack.decode(encode(msg)), **fields})


def poison(run_id: str) -> dict[str, list[tuple[str, bytes]]]:
    task = to_task(next(sample_problems(random.Random(7))), run_id, GROUP, 10_000)
    as_dict = msgspec.msgpack.decode(encode(task))
    ext = msgspec.msgpack.Ext(3, b"\x00" * 8)
    rollout = make_rollout_for(task, "12")
    scored = ScoredRollout(rollout=rollout, reward=1.0, verdict="pass")
    raw_scored = msgspec.msgpack.decode(encode(scored))
    ids = iter(range(100))
    refused = lambda **kw: encode(msgspec.structs.replace(task, task_id=f"refused-{next(ids)}", **kw))  # noqa: E731
    return {
        "tasks": [
            ("random bytes", random.Random(1).randbytes(300)),
            ("truncated msgpack", encode(task)[:-7]),
            ("wrong message type", encode(Heartbeat(run_id=run_id, role="x", instance="h:1", interval_s=5.0))),
            (
                "msgpack Ext in verifier.data",
                msgspec.msgpack.encode({**as_dict, "verifier": {"kind": "python_program", "data": {"x": ext}}}),
            ),
            ("newer schema version", msgspec.msgpack.encode({**as_dict, "schema_version": 999, "field_from_the_future": 1})),
            (
                "verifier.data nested 900 levels",
                msgspec.msgpack.encode({**as_dict, "verifier": {"kind": "python_program", "data": {"x": _nested(900)}}}),
            ),
            ("group_size 100000", msgspec.msgpack.encode({**as_dict, "group_size": 100_000})),
            ("top_p 0.5 on the reference engine", refused(sampling=SamplingParams(top_p=0.5, max_tokens=5))),
            ("max_tokens 1000000", refused(sampling=SamplingParams(max_tokens=1_000_000))),
            ("group_size above the run's limit", refused(group_size=200)),
            ("prompt longer than the context", refused(prompt="1+" * 3000)),
        ],
        "rollouts": [
            ("random bytes", random.Random(2).randbytes(300)),
            (
                "msgpack Ext inside a rollout",
                _with(rollout, task={**as_dict, "verifier": {"kind": "python_program", "data": {"x": ext}}}),
            ),
            ("misaligned arrays", _with(rollout, behaviour_logprobs=b"\x00" * 4 * (len(rollout.completion_token_ids) + 3))),
        ],
        "scored": [
            ("reward NaN", msgspec.msgpack.encode({**raw_scored, "reward": float("nan")})),
            ("reward inf", msgspec.msgpack.encode({**raw_scored, "reward": float("inf")})),
            ("reward 1e308", msgspec.msgpack.encode({**raw_scored, "reward": 1e308})),
            ("msgpack Ext inside a scored record", msgspec.msgpack.encode({**raw_scored, "details": {"x": ext}})),
        ],
        "progress": [("random bytes", random.Random(3).randbytes(100))],
        "admissions": [("random bytes", random.Random(4).randbytes(100))],
        "weights": [("random bytes", random.Random(5).randbytes(100))],
    }


@pytest.mark.timeout(600)
async def test_poison_on_every_topic_is_dead_lettered_and_nothing_stops(tmp_path, kafka_cfg, s3_cfg):
    import uuid

    run_id = f"poison-{uuid.uuid4().hex[:6]}"
    topics = Topics(run_id)
    transport = open_transport(kafka_cfg)
    store = open_object_store(s3_cfg)
    await transport.create_topics(topics.specs(2))
    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    engine = ReferenceEngine(tmp_path / "m", seed=0)
    worker = RolloutWorker(transport, topics, engine, store, learner_batch_samples=2 * GROUP, max_lag=4,
                           tasks_per_batch=4, max_group_size=64, max_context_tokens=512)  # fmt: skip
    bridge = RewardBridge(transport, topics, LocalScorer(open_sandbox(parallel=2)), engine.decode)
    learner = GRPOLearner(transport, topics, model, tok.pad_token_id, store,
                          LearnerConfig(batch_groups=2, max_lag=4, lr=1e-4, checkpoint_every=0), run_dir=tmp_path)  # fmt: skip
    sink = StorageSink(transport, topics, store, SinkConfig(flush_rows=64, flush_s=0.5))
    bad = poison(run_id)
    problems = sample_problems(random.Random(1))
    good = [to_task(next(problems), run_id, GROUP, i) for i in range(8)]
    sent: list[tuple[str, str, int, int]] = []  # (what, topic, partition, offset)
    async with ServiceClients(transport, topics.dead_letter, "test") as io:
        for kind, records in bad.items():
            topic = getattr(topics, kind)
            for what, raw in records:
                res = await io.producer.send_and_wait(topic, raw, b"poison")
                sent.append((f"{kind}: {what}", topic, res.partition, res.offset))
        for t in good:
            await (await io.publisher(topics.tasks).publish(t, t.task_id))
    refused_samples = 2 * GROUP + 200 + GROUP  # top_p, max_tokens, the big group, the long prompt
    expected = len(good) * GROUP + refused_samples
    stop = asyncio.Event()
    services = {"rollout-worker": worker, "reward-bridge": bridge, "learner": learner, "storage-sink": sink}
    runs = {name: asyncio.create_task(s.run(stop)) for name, s in services.items()}
    try:
        for _ in range(2400):
            if learner.samples_consumed >= expected and sink.rows_written >= expected or any(r.done() for r in runs.values()):
                break
            await asyncio.sleep(0.1)
        stopped = [name for name, r in runs.items() if r.done()]
        assert not stopped, {name: runs[name].exception() for name in stopped}  # no service stopped on poison
    finally:
        stop.set()
        await asyncio.gather(*runs.values(), return_exceptions=True)
    async with ServiceClients(transport, topics.dead_letter, "test") as io:
        sub = await io.subscribe([topics.dead_letter], f"check-{uuid.uuid4().hex[:6]}", DeadLetter)
        letters = []
        for _ in range(20):
            letters += [d.message for d in await sub.poll(timeout_s=0.5, max_records=10_000)]
    await transport.close()
    lettered = {(d.source_topic, d.source_partition, d.source_offset) for d in letters}
    missing = [what for what, topic, p, o in sent if (topic, p, o) not in lettered]
    print(f"FIGURE poison_deadlettered {len(sent) - len(missing)}/{len(sent)}")
    assert not missing, missing
    # Every good task generated, scored, trained on and stored; the refused ones answered and counted.
    assert learner.samples_consumed == expected
    stored = list(LakeReader(store, run_id).iter())
    assert len(stored) == expected
    assert sum(s.verdict == "infra" and s.rollout.finish_reason == "error" for s in stored) == refused_samples
    assert sorted({s.rollout.task_id for s in stored if s.rollout.finish_reason != "error"}) == sorted(t.task_id for t in good)
    assert all(decode(encode(s), ScoredRollout) for s in stored)
