"""The rollout worker on in-memory topics with the reference engine: every task's
group published once and committed, weight swaps followed, bad weights refused
while the current version keeps serving, an engine failure ends the worker
with its tasks uncommitted. And the batching shim's abort."""

from __future__ import annotations

import asyncio
import hashlib

import msgspec
import pytest

from conveyor import keys
from conveyor.contracts import Rollout, WeightsAnnouncement
from conveyor.messaging import ServiceClients
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from learner.models import create_tiny_llama
from rollout_workers.engine import BatchingEngine, SamplingRequest
from rollout_workers.reference_engine import ReferenceEngine
from rollout_workers.worker import RolloutWorker
from tasks.suites.pyexpr import ALPHABET, sample_problems, to_task

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    create_tiny_llama(d, ALPHABET, seed=3, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    return d


async def _pipeline(tmp_path, engine, *, n_tasks=6, announce=(), max_inflight=4, task_kw=None, **worker_kw):
    """Run a worker until every task is published (or it fails); return (worker, rollouts, committed, error)."""
    import random

    topics = Topics("r")
    transport = MemoryTransport(partitions=2)
    await transport.create_topics(topics.specs(2))
    store = LocalObjectStore(tmp_path / "objects")
    worker_kw = {"learner_batch_samples": 64, "max_lag": 100, **worker_kw}
    worker = RolloutWorker(transport, topics, engine, store, tasks_per_batch=2, max_inflight_tasks=max_inflight,
                           **worker_kw)  # fmt: skip
    rng = random.Random(0)
    problems = sample_problems(rng)
    async with ServiceClients(transport, topics.dead_letter, "test") as io:
        pub = io.publisher(topics.tasks)
        for i in range(n_tasks):
            task = to_task(next(problems), "r", 3, i)
            if task_kw:
                task = msgspec.structs.replace(task, **task_kw)
            await (await pub.publish(task, f"t{i}"))
        wpub = io.publisher(topics.weights)
        for version, data, sha in announce:
            key = keys.weights_key("r", version)
            store.put(key, data)
            ann = WeightsAnnouncement(
                run_id="r", version=version, key=key, uri=key, sha256=sha or hashlib.sha256(data).hexdigest()
            )
            await (await wpub.publish(ann, "r"))
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        error = None
        for _ in range(400):
            if run.done() or worker.generated >= n_tasks * 3:
                break
            await asyncio.sleep(0.025)
        stop.set()
        try:
            await asyncio.wait_for(run, 30)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            error = exc
        sub = await io.subscribe([topics.rollouts], "check", Rollout)
        rollouts = [d.message for d in await sub.poll(timeout_s=0.5, max_records=10_000)]
    group = transport.broker.groups.get(topics.group("rollout-workers"))
    committed = sum(group.committed.values()) if group else 0
    return worker, rollouts, committed, error


async def test_every_task_is_sampled_published_once_and_committed(tmp_path, model_dir):
    worker, rollouts, committed, error = await _pipeline(tmp_path, ReferenceEngine(model_dir, seed=0))
    assert error is None
    ids = [r.rollout_id for r in rollouts]
    assert len(ids) == len(set(ids)) == 18 and worker.generated == 18
    assert committed == 6
    for r in rollouts:
        assert len(r.completion_token_ids) == len(r.behaviour_logprobs) == len(r.loss_mask)
        assert [(s.start, s.end) for s in r.version_segments] == [(0, len(r.completion_token_ids))]


async def test_swaps_to_announced_weights_and_refuses_bad_ones(tmp_path, model_dir):
    from safetensors.torch import save

    from conveyor.metrics import RolloutMetrics

    metrics = RolloutMetrics.create()
    engine = ReferenceEngine(model_dir, seed=0)
    good = save({k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"})
    misfit = save({"model.embed_tokens.weight": engine.model.model.embed_tokens.weight[:3].clone()})
    worker, rollouts, _, error = await _pipeline(
        tmp_path, engine,
        announce=[(1, good, None), (2, good, "0" * 64), (3, misfit, None)], metrics=metrics,
    )  # fmt: skip
    assert error is None
    # v3 (does not fit) and v2 (checksum mismatch) refused, newest first; v1 swapped in and serves.
    assert worker.engine.version == 1 and worker.swaps == 1 and worker.swaps_refused == 2
    sample = lambda name: metrics.registry.get_sample_value(name)  # noqa: E731
    assert sample("conveyor_weight_swaps_refused_total") == 2 and sample("conveyor_weight_swap_seconds_count") == 1
    assert sample("conveyor_worker_policy_version") == 1 and sample("conveyor_generated_tokens_total") == worker.tokens > 0
    assert len(rollouts) == 18 and {s.policy_version for r in rollouts for s in r.version_segments} == {1}


async def test_admission_holding_tasks_back_is_measured(tmp_path, model_dir):
    from conveyor.metrics import RolloutMetrics

    metrics = RolloutMetrics.create()
    # One learner batch of 3 samples and no lag: the first task's group fills the window, and with
    # no learner reporting progress the other five wait for admission.
    worker, rollouts, _, error = await _pipeline(tmp_path, ReferenceEngine(model_dir, seed=0), metrics=metrics,
                                                 learner_batch_samples=3, max_lag=0)  # fmt: skip
    assert error is None and len(rollouts) == 3
    sample = lambda name: metrics.registry.get_sample_value(name)  # noqa: E731
    assert sample("conveyor_rollout_tasks_waiting_admission") >= 1
    assert sample("conveyor_rollout_admission_wait_seconds_total") > 1.0  # held most of the 10 s the test waits
    assert sample("conveyor_rollout_tasks_running") == 0 and sample("conveyor_rollout_sequences_in_flight") == 0


class _Crashing(ReferenceEngine):
    def generate(self, *args, **kwargs):
        raise RuntimeError("engine lost its device")


async def test_an_engine_failure_ends_the_worker_with_nothing_committed(tmp_path, model_dir):
    worker, rollouts, committed, error = await _pipeline(tmp_path, _Crashing(model_dir, seed=0))
    assert isinstance(error, RuntimeError) and "lost its device" in str(error)
    assert rollouts == [] and committed == 0


class _Hanging(BatchingEngine):
    """An engine whose requests never finish (as vLLM's after its engine process aborted them)."""

    async def generate(self, request):
        await asyncio.Event().wait()


async def test_a_stop_does_not_wait_for_ever_on_an_engine_that_stopped_answering(tmp_path, model_dir):
    worker, rollouts, committed, error = await _pipeline(
        tmp_path, _Hanging(ReferenceEngine(model_dir, seed=0)), drain_timeout_s=0.5
    )
    assert error is None  # the stop ended the worker; what never finished stays uncommitted
    assert rollouts == [] and committed == 0


async def test_batching_engine_aborts_a_queued_request(model_dir):
    engine = BatchingEngine(ReferenceEngine(model_dir, seed=0))
    prompt = engine.encode("a = [1]\nassert a[0] ==")
    first = asyncio.create_task(engine.generate(SamplingRequest(prompt, n=2, max_tokens=4)))
    queued = SamplingRequest(prompt, n=2, max_tokens=4, temperature=0.5)
    second = asyncio.create_task(engine.generate(queued))
    await asyncio.sleep(0)
    await engine.abort(queued.request_id)
    assert [c.finish_reason for c in await second] == ["abort", "abort"]
    assert all(c.finish_reason in ("stop", "length") for c in await first)
    await engine.close()


async def test_admission_is_global_across_workers_and_restarts(tmp_path, model_dir):
    """Two workers on one tasks topic, a bound of one batch (max_lag 0, 6 samples): together they
    start two tasks of three samples, not two each; a worker started later does not start from
    zero; a progress report of the served version lets the next ones in."""
    import random

    from conveyor.contracts import LearnerProgress

    topics = Topics("glob")
    transport = MemoryTransport(partitions=2)
    await transport.create_topics(topics.specs(2))
    store = LocalObjectStore(tmp_path / "objects")

    def worker():
        return RolloutWorker(transport, topics, ReferenceEngine(model_dir, seed=0), store, learner_batch_samples=6,
                             max_lag=0, max_inflight_tasks=8)  # fmt: skip

    problems = sample_problems(random.Random(0))
    stop = asyncio.Event()
    workers = [worker(), worker()]
    runs = [asyncio.create_task(w.run(stop)) for w in workers]
    async with ServiceClients(transport, topics.dead_letter, "test") as io:
        pub = io.publisher(topics.tasks)
        for i in range(12):
            await (await pub.publish(to_task(next(problems), "glob", 3, i), f"t{i}"))

        async def settled(n: int) -> int:
            for _ in range(200):
                total = sum(w.generated for w in workers)
                if total >= n:
                    break
                await asyncio.sleep(0.025)
            await asyncio.sleep(0.5)  # nothing more starts
            return sum(w.generated for w in workers)

        assert await settled(6) == 6  # the bound holds over both workers
        workers.append(worker())  # a worker that joins (or restarts) now
        runs.append(asyncio.create_task(workers[-1].run(stop)))
        assert await settled(6) == 6
        progress = io.publisher(topics.progress)
        await (await progress.publish(LearnerProgress(run_id="glob", samples_consumed=6, policy_version=0), "glob"))
        assert await settled(12) == 12
    stop.set()
    await asyncio.wait_for(asyncio.gather(*runs), 30)
    assert all(w.ledger.claimed_samples == workers[0].ledger.claimed_samples for w in workers)


async def test_a_starting_worker_serves_the_newest_version_without_replaying_older_ones(tmp_path, model_dir):
    from safetensors.torch import save

    engine = ReferenceEngine(model_dir, seed=0)
    good = save({k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"})
    announce = [(v, good, None) for v in range(1, 9)]
    worker, rollouts, _, error = await _pipeline(tmp_path, engine, announce=announce)
    assert error is None
    # Every announcement was in the topic before the worker started: it swapped once, to the newest.
    assert worker.swaps == 1 and worker.engine.version == 8 and worker.swaps_refused == 0
    assert {s.policy_version for r in rollouts for s in r.version_segments} == {8}
