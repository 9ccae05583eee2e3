"""Admission control bounds staleness even when the engine finishes requests out
of order (continuous batching does): worker, bridge and learner on in-memory
topics, an engine whose requests take random times. Rewards are coin flips, so
every group has a signal and every batch is a step (a new version): an untrained
policy would fail every task, and batches that train nothing advance no version."""

from __future__ import annotations

import asyncio
import random

import pytest

from conveyor.config import LearnerConfig
from conveyor.messaging import ServiceClients
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from learner.models import create_tiny_llama
from learner.recipe import GRPOLearner
from reward.bridge import RewardBridge
from rollout_workers.engine import BatchingEngine
from rollout_workers.reference_engine import ReferenceEngine
from rollout_workers.worker import RolloutWorker
from tasks.suites.pyexpr import ALPHABET, sample_problems, to_task
from tasks.verifiers import Verdict

pytestmark = pytest.mark.integration


class CoinFlips:
    """A scorer whose verdicts are seeded coin flips: what staleness is measured against is the
    policy versions, not what the rewards say."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def submit(self, items):
        loop = asyncio.get_running_loop()
        out = []
        for _ in items:
            fut = loop.create_future()
            fut.set_result(Verdict(1.0, "pass") if self.rng.random() < 0.5 else Verdict(0.0, "fail"))
            out.append(fut)
        return out


class OutOfOrder(BatchingEngine):
    """The reference engine, with each request's completion delayed by a random time."""

    def __init__(self, engine, seed: int) -> None:
        super().__init__(engine)
        self.rng = random.Random(seed)

    async def generate(self, request):
        out = await super().generate(request)
        await asyncio.sleep(self.rng.choice([0.0, 0.0, 0.05, 0.4]))
        return out


@pytest.mark.parametrize("max_lag", [0, 1])
async def test_staleness_never_exceeds_max_lag_with_out_of_order_completion(tmp_path, max_lag):
    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    topics = Topics("adm")
    transport = MemoryTransport(partitions=4)
    await transport.create_topics(topics.specs(4))
    store = LocalObjectStore(tmp_path / "o")
    group, batch_groups, n_tasks = 4, 2, 36
    engine = OutOfOrder(ReferenceEngine(tmp_path / "m", seed=0), seed=max_lag)
    worker = RolloutWorker(transport, topics, engine, store, learner_batch_samples=batch_groups * group, max_lag=max_lag,
                           tasks_per_batch=4, max_inflight_tasks=8)  # fmt: skip
    bridge = RewardBridge(transport, topics, CoinFlips(seed=max_lag), engine.decode)
    cfg = LearnerConfig(batch_groups=batch_groups, max_lag=max_lag, lr=1e-3, checkpoint_every=0)
    learner = GRPOLearner(transport, topics, model, tok.pad_token_id, store, cfg, run_dir=tmp_path)
    problems = sample_problems(random.Random(1))
    async with ServiceClients(transport, topics.dead_letter, "test") as io:
        pub = io.publisher(topics.tasks)
        await asyncio.gather(*[await pub.publish(to_task(next(problems), "adm", group, i), f"t{i}") for i in range(n_tasks)])
    stop = asyncio.Event()
    runs = [asyncio.create_task(s.run(stop)) for s in (worker, bridge, learner)]
    for _ in range(1200):
        if learner.samples_consumed >= n_tasks * group or any(r.done() for r in runs):
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.gather(*runs)
    assert learner.samples_consumed == n_tasks * group and learner.step >= 15
    assert max(learner.staleness) <= max_lag, dict(learner.staleness)
    assert learner.counters["samples_stale_dropped"] == 0
