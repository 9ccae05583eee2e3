"""Poison that decodes, or nearly does: every consumer refuses it with a reason and carries on.

Contracts refuse msgpack extension types, schema versions newer than the code, non-finite or
absurd rewards and payloads nested past the limit; the bridge turns a verifier's unreadable
result into an ``error`` verdict; the rollout worker answers a task it cannot serve with a dead
letter and ``error`` rollouts (and keeps serving the rest); the sink dead-letters a row the lake
cannot hold; the trainer drops an update whose gradient is not finite."""

from __future__ import annotations

import asyncio
import copy
import math

import msgspec
import pytest
import torch

from conveyor.contracts import (
    DeadLetter,
    DecodeError,
    Rollout,
    SamplingParams,
    ScoredRollout,
    Task,
    VerifierSpec,
    VersionSegment,
    decode,
    encode,
)
from conveyor.messaging import ServiceClients
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport

pytestmark = pytest.mark.unit


def _task(**kw) -> Task:
    return Task(task_id=kw.pop("task_id", "t"), run_id="r", prompt="1+1=", group_size=kw.pop("group_size", 2), **kw)


def _rollout(rid: str = "ro-1", task: Task | None = None) -> Rollout:
    return Rollout(rollout_id=rid, task_id="t", run_id="r", sample_index=0, prompt_token_ids=[1, 2],
                   completion_token_ids=[3], behaviour_logprobs=[-0.5], loss_mask=[1],
                   version_segments=[VersionSegment(start=0, end=1, policy_version=0)],
                   task=task)  # fmt: skip


def _raw(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def _nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


def _task_dict(**data) -> dict:
    return {"t": "task", "task_id": "t", "run_id": "r", "prompt": "x", "verifier": {"kind": "math", "data": data}}


@pytest.mark.parametrize(
    "raw",
    [
        _raw(_task_dict(x=msgspec.msgpack.Ext(1, b"boom"))),
        _raw({**_task_dict(), "schema_version": 999, "future_field": {"a": 1}}),
        _raw(_task_dict(deep=_nested(40))),
        _raw({**_task_dict(), "group_size": 100_000}),
    ],
    ids=["ext-type", "newer-schema", "nested-too-deep", "group-too-large"],
)
def test_tasks_that_decode_into_poison_are_refused(raw):
    with pytest.raises(DecodeError):
        decode(raw, Task)


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, 1e308])
def test_scored_rollouts_with_unusable_rewards_are_refused(reward):
    good = ScoredRollout(rollout=_rollout(), reward=1.0, verdict="pass")
    raw = encode(good).replace(msgspec.msgpack.encode(1.0), msgspec.msgpack.encode(float(reward)), 1)
    assert raw != encode(good)
    with pytest.raises(DecodeError, match="reward"):
        decode(raw, ScoredRollout)
    with pytest.raises(ValueError, match="reward"):
        ScoredRollout(rollout=_rollout(), reward=reward, verdict="pass")


def test_depth_limit_admits_what_verifiers_use():
    VerifierSpec(kind="tool_call", data={"expected": [{"name": "f", "arguments": {"a": [1, {"b": 2}]}}]})
    deep: dict = {}
    node = deep
    for _ in range(40):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ValueError, match="nested deeper"):
        VerifierSpec(kind="math", data=deep)


@pytest.mark.parametrize(
    ("reward", "verdict"),
    [(math.nan, "pass"), (math.inf, "pass"), (1e300, "fail"), ("high", "pass"), (1.0, "excellent")],
)
def test_the_bridge_turns_an_unreadable_verdict_into_an_error(reward, verdict):
    from reward.bridge import _scored
    from tasks.verifiers import Verdict

    s = _scored(_rollout(), Verdict(reward, verdict), "text")
    assert (s.reward, s.verdict) == (0.0, "error")
    assert "refused" in s.feedback.message
    decode(encode(s), ScoredRollout)  # and the learner can read it


def test_the_bridge_scores_error_rollouts_infra_without_the_scorer():
    from reward.bridge import RewardBridge
    from rollout_workers.refusals import error_rollouts

    class Exploding:
        def submit(self, items):
            raise AssertionError("error rollouts are not scored")

    bridge = RewardBridge(None, Topics("r"), Exploding(), decode_text=lambda ids: "")
    scored = asyncio.run(bridge.score(error_rollouts(_task(group_size=3), "too long", 0)))
    assert [s.verdict for s in scored] == ["infra"] * 3
    assert all("too long" in s.feedback.message for s in scored)


def test_the_bridge_survives_a_scorer_that_raises():
    from reward.bridge import RewardBridge

    class Broken:
        def submit(self, items):
            raise RecursionError("maximum recursion depth exceeded while pickling")

    bridge = RewardBridge(None, Topics("r"), Broken(), decode_text=lambda ids: "x")
    scored = asyncio.run(bridge.score([_rollout(task=_task())]))
    assert scored[0].verdict == "infra" and "RecursionError" in scored[0].feedback.message


def test_refusals_name_the_reason():
    from rollout_workers.refusals import TaskLimits, prompt_refusal, refusal

    limits = TaskLimits(max_group_size=64, max_context_tokens=128, max_claims=3, top_p=False)
    sp = SamplingParams(max_tokens=16)
    assert refusal(_task(), sp, 1, limits) is None
    assert "group_size 65" in refusal(_task(group_size=65), sp, 1, limits)
    assert "claimed 3 times" in refusal(_task(), sp, 3, limits)
    assert "top_p" in refusal(_task(), SamplingParams(top_p=0.5, max_tokens=16), 1, limits)
    assert "max_tokens 1000000" in refusal(_task(), SamplingParams(max_tokens=1_000_000), 1, limits)
    assert "exceeds" in prompt_refusal(120, sp, limits)
    assert refusal(_task(), SamplingParams(temperature=0.0, max_tokens=16), 1, limits) is None  # greedy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    d = tmp_path_factory.mktemp("model")
    create_tiny_llama(d, ALPHABET, seed=3, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    return d


def test_a_worker_refuses_poison_tasks_and_serves_the_rest(tmp_path, model_dir):
    """Tasks that used to end every worker that took them (temperature 0 with the reference
    engine, top_p below 1, a million max tokens, a group of 1000) are answered with a dead letter
    and error rollouts, or served greedily; the good tasks around them are served."""
    from rollout_workers.reference_engine import ReferenceEngine
    from rollout_workers.worker import RolloutWorker

    async def main():
        topics = Topics("r")
        transport = MemoryTransport(partitions=1)
        await transport.create_topics(topics.specs(1))
        worker = RolloutWorker(transport, topics, ReferenceEngine(model_dir, seed=0), LocalObjectStore(tmp_path / "o"),
                               learner_batch_samples=10_000, max_lag=10, tasks_per_batch=2, max_group_size=64)  # fmt: skip
        tasks = [
            _task(task_id="ok-1"),
            _task(task_id="greedy", sampling=SamplingParams(temperature=0.0, max_tokens=4)),
            _task(task_id="top-p", sampling=SamplingParams(top_p=0.5, max_tokens=4)),
            _task(task_id="long", sampling=SamplingParams(max_tokens=1_000_000)),
            _task(task_id="huge-group", group_size=1000),
            _task(task_id="ok-2"),
        ]
        async with ServiceClients(transport, topics.dead_letter, "test") as io:
            pub = io.publisher(topics.tasks)
            for t in tasks:
                await (await pub.publish(t, t.task_id))
            stop = asyncio.Event()
            run = asyncio.create_task(worker.run(stop))
            expected = sum(t.group_size for t in tasks)
            for _ in range(800):
                if run.done() or worker.generated >= expected:
                    break
                await asyncio.sleep(0.025)
            stop.set()
            await asyncio.wait_for(run, 30)  # it never failed
            rollouts = [d.message for d in await (await io.subscribe([topics.rollouts], "c", Rollout)).poll(0.5, 10_000)]
            letters = [d.message for d in await (await io.subscribe([topics.dead_letter], "c", DeadLetter)).poll(0.5, 100)]
        return worker, rollouts, letters

    worker, rollouts, letters = asyncio.run(main())
    by_task: dict[str, list[Rollout]] = {}
    for r in rollouts:
        by_task.setdefault(r.task_id, []).append(r)
    assert {t: len(rs) for t, rs in by_task.items()} == {
        "ok-1": 2,
        "greedy": 2,
        "top-p": 2,
        "long": 2,
        "huge-group": 1000,
        "ok-2": 2,
    }
    for refused in ("top-p", "long", "huge-group"):
        assert all(r.finish_reason == "error" and r.error and not len(r.completion_token_ids) for r in by_task[refused])
    greedy = by_task["greedy"]
    assert greedy[0].completion_token_ids.tolist() == greedy[1].completion_token_ids.tolist()  # greedy: identical
    assert all(r.finish_reason != "error" for t in ("ok-1", "ok-2", "greedy") for r in by_task[t])
    assert sorted(decode(d.raw, Task).task_id for d in letters) == ["huge-group", "long", "top-p"]
    assert all(d.error.startswith("TaskRefused") for d in letters)
    assert worker.tasks_refused == 3


def test_the_ledger_counts_claims_of_an_attempt():
    from conveyor.admission import AdmissionLedger
    from conveyor.contracts import Admission

    ledger = AdmissionLedger("r", "me", None, None)
    for member in ("a", "b", "c"):
        ledger.apply(Admission(run_id="r", kind="claim", member=member, keys=["t/0"], samples=[4]))
    ledger.apply(Admission(run_id="r", kind="claim", member="a", keys=["u/0"], samples=[4]))
    assert (ledger.claims("t/0"), ledger.claims("u/0"), ledger.claims("v/0")) == (3, 1, 0)
    assert ledger.ticket("t/0") == 4  # the first claim's ticket


def test_the_sink_dead_letters_a_row_the_lake_cannot_hold(tmp_path, monkeypatch):
    import storage.columns as columns
    import storage.sink as sink_module
    from conveyor.config import SinkConfig
    from storage.lake import LakeReader
    from storage.sink import StorageSink

    real = columns.table_from_rows

    def picky(rows):
        if any(r.rollout_id == "ro-bad" for r in rows):
            raise TypeError("cannot convert this row")
        return real(rows)

    monkeypatch.setattr(columns, "table_from_rows", picky)
    monkeypatch.setattr(sink_module, "table_from_rows", picky)

    async def main():
        topics = Topics("r")
        transport = MemoryTransport(partitions=1)
        await transport.create_topics(topics.specs(1))
        store = LocalObjectStore(tmp_path / "o")
        sink = StorageSink(transport, topics, store, SinkConfig(flush_rows=10, flush_s=0.1))
        async with ServiceClients(transport, topics.dead_letter, "test") as io:
            pub = io.publisher(topics.scored)
            for rid in ("ro-1", "ro-bad", "ro-2"):
                await (await pub.publish(ScoredRollout(rollout=_rollout(rid), reward=1.0, verdict="pass"), "t"))
            stop = asyncio.Event()
            run = asyncio.create_task(sink.run(stop))
            for _ in range(200):
                if sink.rows_written >= 2:
                    break
                await asyncio.sleep(0.025)
            stop.set()
            await asyncio.wait_for(run, 10)
            letters = [d.message for d in await (await io.subscribe([topics.dead_letter], "c", DeadLetter)).poll(0.5, 100)]
        return sink, store, letters

    sink, store, letters = asyncio.run(main())
    assert sorted(s.rollout_id for s in LakeReader(store, "r").iter()) == ["ro-1", "ro-2"]
    assert [decode(d.raw, ScoredRollout).rollout_id for d in letters] == ["ro-bad"]
    assert letters[0].error.startswith("Unstorable: TypeError")
    assert sink.rows_dead_lettered == 1


def test_an_update_with_a_non_finite_gradient_is_dropped(tmp_path):
    from conveyor.config import LearnerConfig
    from learner.models import create_tiny_llama
    from learner.trainer import Trainer
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    before = copy.deepcopy(model.state_dict())
    trainer = Trainer(model, tok.pad_token_id, LearnerConfig())
    work = {
        "prompts": [[5, 6, 7]] * 2,
        "completions": [[8, 9], [10, 11]],
        "behaviour": [torch.tensor([-0.5, float("nan")]), torch.tensor([-0.5, -0.7])],
        "advantages": [1.0, -1.0],
        "masks": [torch.ones(2), torch.ones(2)],
    }
    stats = trainer.step(work)
    assert stats["nonfinite_updates_skipped"] == 1
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_worker_refuses_weights_from_elsewhere_and_weights_of_nans(tmp_path, model_dir):
    import hashlib

    from safetensors.torch import load, save

    from conveyor import keys
    from conveyor.contracts import WeightsAnnouncement
    from rollout_workers.reference_engine import ReferenceEngine
    from rollout_workers.worker import RolloutWorker

    store = LocalObjectStore(tmp_path / "o")
    worker = RolloutWorker(MemoryTransport(), Topics("r"), ReferenceEngine(model_dir, seed=0), store, learner_batch_samples=8)
    state = load(next(model_dir.glob("*.safetensors")).read_bytes())

    def announce(version: int, key: str, tensors: dict) -> bool:
        data = save(tensors)
        if ".." not in key:  # the store refuses such a key itself; the worker must not even ask
            store.put(key, data)
        ann = WeightsAnnouncement(run_id="r", version=version, key=key, uri=key, sha256=hashlib.sha256(data).hexdigest())
        return asyncio.run(worker._swap(ann))

    poisoned = {k: v.clone() for k, v in state.items()}
    next(iter(poisoned.values())).view(-1)[0] = float("nan")
    assert not announce(1, "runs/r/weights/../../other/v000001/model.safetensors", state)
    assert not announce(1, keys.weights_key("other-run", 1), state)
    assert not announce(1, keys.weights_key("r", 1), poisoned)
    assert worker.swaps_refused == 3 and worker.engine.version == 0
    assert announce(2, keys.weights_key("r", 2), state)  # and a good one is still taken
    assert worker.engine.version == 2


def test_a_learner_without_checkpoints_refuses_a_run_that_already_trained(tmp_path):
    """Its predecessor committed offsets every step: starting again from the initial policy would
    silently train on top of them and publish versions that exist."""
    from conveyor import keys
    from conveyor.config import LearnerConfig
    from conveyor.errors import ConfigError
    from learner.models import create_tiny_llama
    from learner.recipe import GRPOLearner
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    store = LocalObjectStore(tmp_path / "o")
    store.put(keys.weights_key("r", 3), b"weights")
    transport = MemoryTransport()
    learner = GRPOLearner(
        transport, Topics("r"), model, tok.pad_token_id, store, LearnerConfig(checkpoint_every=0), run_dir=tmp_path
    )
    with pytest.raises(ConfigError, match="checkpoint_every"):
        asyncio.run(learner.run(asyncio.Event()))
