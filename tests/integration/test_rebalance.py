"""Rebalances mid-batch, on the real Kafka-protocol broker: every consumer group member of the
pipeline keeps going when its partitions move, and the run loses nothing and trains nothing twice.

For each consumer (storage sink, reward bridge, learner, rollout worker) a second instance joins
the group while the first has work in flight, then the first stops (the group rebalances again)
and the run finishes. Where the work in flight outlasts the rebalance (the sink's writes, a
bridge waiting for verdicts or a learner's step past ``max_poll_interval_ms``, when the broker
drops the member from its group) its commit is refused, and the service carries on. Each test
checks what a user would notice: every rollout in the lake once, every rollout scored, every
task generated, every scored rollout trained on exactly once, and every service running until
it was told to stop, then stopping without an error.

The learner is one member per run: a second learner in its group (started by mistake) makes
both wait without training until one of them leaves.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from collections import Counter

import pytest

from conveyor.config import BridgeConfig, LearnerConfig, SinkConfig
from conveyor.contracts import Rollout, ScoredRollout, rollout_id
from conveyor.messaging import ServiceClients
from conveyor.objectstore import LocalObjectStore, open_object_store
from conveyor.topics import Topics
from conveyor.transport import open_transport
from learner.models import create_tiny_llama
from learner.recipe import GRPOLearner
from reward.bridge import RewardBridge
from rollout_workers.engine import BatchingEngine
from rollout_workers.reference_engine import ReferenceEngine
from rollout_workers.worker import RolloutWorker
from storage.lake import LakeReader
from storage.sink import StorageSink
from tasks.suites.pyexpr import ALPHABET, sample_problems, to_task
from tasks.verifiers import Verdict
from tests.conftest import decode_bytes, make_rollout_for
from tests.scored_factory import scored_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GROUP = 4
PARTITIONS = 4


class _Services:
    """Services run as tasks, each with its own stop event. ``until`` fails at once if one ended
    before it was told to stop; ``stop`` waits for it and re-raises its error; on the way out
    (a failed test) whatever still runs is cancelled, helpers (``side``) included."""

    def __init__(self) -> None:
        self.runs: dict[str, asyncio.Task] = {}
        self.stops: dict[str, asyncio.Event] = {}
        self.sides: list[asyncio.Task] = []

    def start(self, name: str, service) -> None:
        self.stops[name] = asyncio.Event()
        self.runs[name] = asyncio.create_task(service.run(self.stops[name]))

    def side(self, coro) -> asyncio.Task:
        self.sides.append(asyncio.create_task(coro))
        return self.sides[-1]

    async def until(self, cond, what: str, timeout_s: float = 40.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            ended = {name: r for name, r in self.runs.items() if r.done()}
            assert not ended, {name: r.exception() for name, r in ended.items()}  # None: it returned on its own
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.1)

    async def stop(self, name: str, timeout_s: float = 30.0) -> None:
        self.stops[name].set()
        await asyncio.wait_for(self.runs.pop(name), timeout_s)

    async def __aenter__(self) -> _Services:
        return self

    async def __aexit__(self, *exc) -> None:
        leftover = [*self.runs.values(), *self.sides]
        for task in leftover:
            task.cancel()
        await asyncio.gather(*leftover, return_exceptions=True)


async def _setup(kafka_cfg, name: str) -> tuple[Topics, object]:
    topics = Topics(f"rebal-{name}-{uuid.uuid4().hex[:6]}")
    transport = open_transport(kafka_cfg)
    await transport.create_topics(topics.specs(PARTITIONS))
    return topics, transport


class _Collector:
    """Reads a topic whole (a reader in no group) until stopped: the rollout ids it carries, with repeats."""

    def __init__(self, transport, topics: Topics, topic: str, message_type) -> None:
        self.ids: Counter[str] = Counter()
        self._args = (transport, topics, topic, message_type)

    async def run(self, stop: asyncio.Event) -> None:
        transport, topics, topic, message_type = self._args
        async with ServiceClients(transport, topics.dead_letter, "test") as io:
            sub = await io.subscribe([topic], None, message_type)
            while not stop.is_set():
                for d in await sub.poll(timeout_s=0.2, max_records=10_000):
                    self.ids[d.message.rollout_id] += 1


async def _publish(transport, topics: Topics, topic: str, messages: list, key, per_s: float | None = None) -> None:
    """Publish ``messages`` (at ``per_s`` a second, or at once)."""
    async with ServiceClients(transport, topics.dead_letter, "test") as io:
        pub = io.publisher(topic)
        for m in messages:
            await (await pub.publish(m, key(m)))
            if per_s:
                await asyncio.sleep(1 / per_s)


# ---------------------------------------------------------------------------------- storage sink


class _SlowWrites:
    """An object store whose part writes take ``delay_s`` longer (a slow S3 server), and wait while
    the writes are held (``hold``/``release``): a write in flight then outlasts a rebalance however
    long the broker takes over it."""

    def __init__(self, store, delay_s: float) -> None:
        self._store = store
        self.delay_s = delay_s
        self._open = threading.Event()
        self._open.set()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def put_if_absent(self, *args, **kwargs):
        # the sink writes in a thread; the wait is bounded so a failed test cannot hang a thread
        self._open.wait(timeout=120)
        time.sleep(self.delay_s)
        return self._store.put_if_absent(*args, **kwargs)


async def test_storage_sinks_rebalanced_mid_flush_store_every_rollout_once(kafka_cfg, s3_cfg):
    topics, transport = await _setup(kafka_cfg, "sink")
    store = _SlowWrites(open_object_store(s3_cfg), delay_s=0.2)
    rows = [s for g in range(60) for s in scored_group(topics.run_id, g, GROUP)]
    cfg = SinkConfig(flush_rows=16, flush_s=0.2, max_inflight=2)
    first, second = StorageSink(transport, topics, store, cfg), StorageSink(transport, topics, store, cfg)
    async with _Services() as svc:
        svc.start("first", first)
        # Keyed by rollout, so that the rows a sink holds at any moment span every partition: whichever
        # partitions the rebalance moves, the first sink holds rows of them.
        feed = svc.side(_publish(transport, topics, topics.scored, rows, lambda s: s.rollout_id, per_s=25))
        await svc.until(lambda: first.rows_written >= 32, "the first sink's writes")
        # Writes now wait until the rebalance is over (the second sink has read a record): the flushes
        # the first sink holds when the second joins land after their partitions moved, and the second
        # sink, which started from the table's offsets, re-read their records. Whichever commits those
        # partitions second is refused, and drops the records the other stored.
        store.hold()
        svc.start("second", second)
        await svc.until(lambda: second.first_record_at is not None, "the rebalance (the second sink's first record)", 60)
        store.release()
        await svc.until(lambda: first.commits_refused + second.commits_refused > 0, "a commit refused after the rebalance")
        await svc.until(lambda: second.rows_written > 0, "the second sink's first write")
        await svc.stop("first")  # drains and leaves: its partitions move again
        await feed
        await svc.until(lambda: first.rows_written + second.rows_written >= len(rows), "every row written")
        await svc.until(lambda: len({s.rollout_id for s in LakeReader(store, topics.run_id).iter()}) == len(rows),
                        "every rollout in the lake")  # fmt: skip
        await svc.stop("second")
    await transport.close()
    stored = [s.rollout_id for s in LakeReader(store, topics.run_id).iter()]
    assert sorted(stored) == sorted(s.rollout_id for s in rows)  # each once, none missing
    assert first.rows_written + second.rows_written == len(rows)  # no row committed twice, by either
    print(f"FIGURE sink_rebalance rows_written={first.rows_written}+{second.rows_written}/{len(rows)} "
          f"commits_refused={first.commits_refused}+{second.commits_refused} "
          f"already_stored={first.already_stored}+{second.already_stored}")  # fmt: skip


# --------------------------------------------------------------------------------- reward bridge


class _SlowVerdicts:
    """Each verdict comes back ``delay_s`` after it was asked for (a reward tier under load)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def submit(self, items):
        loop = asyncio.get_running_loop()
        out = []
        for _ in items:
            fut = loop.create_future()
            loop.call_later(self.delay_s, lambda f: f.done() or f.set_result(Verdict(1.0, "pass")), fut)
            out.append(fut)
        return out


async def test_reward_bridges_rebalanced_mid_batch_score_every_rollout(kafka_cfg):
    topics, transport = await _setup(kafka_cfg, "bridge")
    problems = sample_problems(random.Random(1))
    tasks = [to_task(next(problems), topics.run_id, GROUP, i) for i in range(40)]
    rollouts = [make_rollout_for(t, "12", i) for t in tasks for i in range(GROUP)]
    cfg = BridgeConfig(max_batch=8, max_inflight=8)
    first = RewardBridge(transport, topics, _SlowVerdicts(0.5), decode_bytes, cfg)
    second = RewardBridge(transport, topics, _SlowVerdicts(0.5), decode_bytes, cfg)
    scored = _Collector(transport, topics, topics.scored, ScoredRollout)
    await _publish(transport, topics, topics.rollouts, rollouts, lambda r: r.task_id)
    async with _Services() as svc:
        svc.start("scored", scored)
        svc.start("first", first)
        await svc.until(lambda: first.scored >= 16, "the first bridge's verdicts")
        svc.start("second", second)  # joins with rollouts in flight at the first
        await svc.until(lambda: second.scored > 0, "the second bridge's first verdict")
        await svc.stop("first")
        await svc.until(lambda: len(scored.ids) == len(rollouts), "every rollout scored")
        await svc.stop("second")
        await svc.stop("scored")
    await transport.close()
    assert set(scored.ids) == {r.rollout_id for r in rollouts}
    print(f"FIGURE bridge_rebalance scored={first.scored}+{second.scored}/{len(rollouts)} "
          f"published_twice={sum(n > 1 for n in scored.ids.values())}")  # fmt: skip


async def _a_reward_bridge_waiting_past_max_poll_interval_scores_every_rollout(kafka_cfg):
    """Every slot waiting for a verdict, the bridge polls nothing: past ``max_poll_interval_ms`` the
    broker drops it from its group, its commit is refused, and it rejoins and carries on."""
    topics, transport = await _setup(kafka_cfg.model_copy(update={"max_poll_interval_ms": 1000}), "bridgewait")
    problems = sample_problems(random.Random(2))
    tasks = [to_task(next(problems), topics.run_id, GROUP, i) for i in range(6)]
    rollouts = [make_rollout_for(t, "12", i) for t in tasks for i in range(GROUP)]
    bridge = RewardBridge(transport, topics, _SlowVerdicts(1.6), decode_bytes, BridgeConfig(max_batch=8, max_inflight=8))
    scored = _Collector(transport, topics, topics.scored, ScoredRollout)
    await _publish(transport, topics, topics.rollouts, rollouts, lambda r: r.task_id)
    async with _Services() as svc:
        svc.start("scored", scored)
        svc.start("bridge", bridge)
        await svc.until(lambda: len(scored.ids) == len(rollouts), "every rollout scored", timeout_s=60)
        await svc.stop("bridge")
        await svc.stop("scored")
    await transport.close()
    assert set(scored.ids) == {r.rollout_id for r in rollouts}
    print(f"FIGURE bridge_poll_overrun scored={bridge.scored}/{len(rollouts)} "
          f"published_twice={sum(n > 1 for n in scored.ids.values())}")  # fmt: skip


# -------------------------------------------------------------------------------------- learner


def _learner(transport, topics: Topics, tmp_path, name: str, cfg: LearnerConfig, store, cls=GRPOLearner) -> GRPOLearner:
    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    (tmp_path / name).mkdir(exist_ok=True)
    return cls(transport, topics, model, tok.pad_token_id, store, cfg, run_dir=tmp_path / name)


def _trained_once(learner: GRPOLearner, rows: list[ScoredRollout]) -> None:
    """Every rollout trained on, each once: the samples of every step (metrics.jsonl) add up to the
    distinct ids the learner's ledger holds, and those are the ids published."""
    steps = [json.loads(line) for line in (learner.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert set(learner.batcher.trained_log) == {s.rollout_id for s in rows}  # nothing lost
    assert sum(row["trained_samples"] for row in steps) == len(rows)  # nothing trained twice
    assert learner.samples_consumed == len(rows)


async def test_a_second_learner_in_the_group_makes_both_wait_and_nothing_is_trained_twice(kafka_cfg, tmp_path):
    topics, transport = await _setup(kafka_cfg, "learner")
    store = LocalObjectStore(tmp_path / "objects")
    rows = [s for g in range(24) for s in scored_group(topics.run_id, g, GROUP)]
    cfg = LearnerConfig(batch_groups=2, max_lag=1000, lr=1e-3, checkpoint_every=2, straggler_wait_s=0)
    first = _learner(transport, topics, tmp_path, "first", cfg, store)
    second = _learner(transport, topics, tmp_path, "second", cfg, store)  # by mistake: the same run and group
    async with _Services() as svc:
        svc.start("first", first)
        feed = svc.side(_publish(transport, topics, topics.scored, rows, lambda s: s.rollout.task_id, per_s=8))
        await svc.until(lambda: first.step >= 3, "the first learner's first checkpoint")
        svc.start("second", second)
        await svc.until(lambda: first.counters["rebalance_waits"] and second.counters["rebalance_waits"],
                        "both learners waiting for the partitions the other holds")  # fmt: skip
        held_at = first.step
        await asyncio.sleep(2.0)  # records keep arriving: neither trains while the other holds some partitions
        assert (first.step, second.step) == (held_at, second.resumed_from)
        await svc.stop("second")  # the one started by mistake leaves
        await feed
        await svc.until(lambda: first.samples_consumed >= len(rows), "the first learner to train on everything")
        await svc.stop("first")
    await transport.close()
    _trained_once(first, rows)
    assert second.step == second.resumed_from and (second.run_dir / "metrics.jsonl").read_text() == ""  # it trained nothing


class _SlowStepLearner(GRPOLearner):
    def train_step(self, batch):
        time.sleep(1.6)  # longer than the consumer's max_poll_interval: dropped from its group mid-step
        return super().train_step(batch)


async def _a_learner_whose_steps_outlast_max_poll_interval_trains_every_rollout_once(kafka_cfg, tmp_path):
    short = kafka_cfg.model_copy(update={"max_poll_interval_ms": 1000})
    topics, transport = await _setup(short, "slowstep")
    rows = [s for g in range(8) for s in scored_group(topics.run_id, g, GROUP)]
    await _publish(transport, topics, topics.scored, rows, lambda s: s.rollout.task_id)
    cfg = LearnerConfig(batch_groups=2, max_lag=1000, lr=1e-3, checkpoint_every=0, straggler_wait_s=0)
    learner = _learner(transport, topics, tmp_path, "slow", cfg, LocalObjectStore(tmp_path / "objects"), _SlowStepLearner)
    async with _Services() as svc:
        svc.start("learner", learner)
        await svc.until(lambda: learner.samples_consumed >= len(rows), "every rollout consumed", timeout_s=50)
        await asyncio.sleep(1.0)  # redeliveries after the last rejoin are skipped, not trained
        await svc.stop("learner")
    await transport.close()
    _trained_once(learner, rows)
    assert learner.counters["commits_after_rebalance"] >= 1  # it was dropped from its group and carried on
    print(f"FIGURE learner_poll_overrun steps={learner.step} commits_refused={learner.counters['commits_after_rebalance']} "
          f"duplicates_skipped={learner.counters['duplicates_skipped']}")  # fmt: skip


async def test_a_bridge_and_a_learner_that_outlast_max_poll_interval_carry_on(kafka_cfg, tmp_path):
    """Both at once, each on its own run's topics: most of either is waiting for the broker to drop
    a member that stopped polling, so together they take the time of one."""
    await asyncio.gather(
        _a_reward_bridge_waiting_past_max_poll_interval_scores_every_rollout(kafka_cfg),
        _a_learner_whose_steps_outlast_max_poll_interval_trains_every_rollout_once(kafka_cfg, tmp_path),
    )


# -------------------------------------------------------------------------------- rollout worker


class _SlowEngine(BatchingEngine):
    """The reference engine, each request taking ``delay_s`` longer: tasks are in flight when the group rebalances."""

    def __init__(self, engine, delay_s: float) -> None:
        super().__init__(engine)
        self.delay_s = delay_s

    async def generate(self, request):
        out = await super().generate(request)
        await asyncio.sleep(self.delay_s)
        return out


async def test_rollout_workers_rebalanced_mid_batch_generate_every_task(kafka_cfg, tmp_path):
    topics, transport = await _setup(kafka_cfg, "worker")
    create_tiny_llama(tmp_path / "m", ALPHABET, seed=0, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    store = LocalObjectStore(tmp_path / "objects")
    problems = sample_problems(random.Random(1))
    tasks = [to_task(next(problems), topics.run_id, GROUP, i) for i in range(32)]

    def worker() -> RolloutWorker:
        engine = _SlowEngine(ReferenceEngine(tmp_path / "m", seed=0), delay_s=0.8)
        return RolloutWorker(transport, topics, engine, store, learner_batch_samples=10_000, tasks_per_batch=4,
                             max_inflight_tasks=4)  # fmt: skip

    first, second = worker(), worker()
    generated = _Collector(transport, topics, topics.rollouts, Rollout)
    await _publish(transport, topics, topics.tasks, tasks, lambda t: t.task_id)
    async with _Services() as svc:
        svc.start("rollouts", generated)
        svc.start("first", first)
        await svc.until(lambda: first.generated >= 4 * GROUP, "the first worker's rollouts")
        svc.start("second", second)  # joins with tasks in flight at the first
        await svc.until(lambda: second.generated > 0, "the second worker's first rollouts")
        await svc.stop("first")
        await svc.until(lambda: len(generated.ids) == len(tasks) * GROUP, "every task generated")
        await svc.stop("second")
        await svc.stop("rollouts")
    await transport.close()
    assert set(generated.ids) == {rollout_id(t.task_id, i, t.attempt) for t in tasks for i in range(GROUP)}
    assert first.tasks_refused == second.tasks_refused == 0
    print(f"FIGURE worker_rebalance rollouts={first.generated}+{second.generated}/{len(tasks) * GROUP}")
