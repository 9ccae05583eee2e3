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


async def _run(tmp_path, groups: list[list], *, wait_for_consumed: int, prometheus=None, tracker=None):
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    transport, topics = MemoryTransport(), Topics("ver")
    await transport.create_topics(topics.specs(1))
    cfg = LearnerConfig(batch_groups=1, max_lag=100, lr=3e-4, checkpoint_every=0)
    learner = GRPOLearner(
        transport, topics, model, tok.pad_token_id, LocalObjectStore(tmp_path / "objects"), cfg, run_dir=tmp_path
    )
    learner.prometheus = prometheus or learner.prometheus
    learner.tracker = tracker
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


async def test_the_step_rows_are_served_as_prometheus_series(tmp_path):
    import json
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conveyor.metrics import LearnerMetrics, serve_metrics
    from conveyor.tracking import TensorBoardBackend, Tracker

    prometheus = LearnerMetrics.create()
    tracker = Tracker(TensorBoardBackend(tmp_path / "tb"))
    tracker.start("ver", {"learner": {"lr": 3e-4}})
    groups = [scored_group("ver", 0, 2), _flat("ver", 1), scored_group("ver", 3, 2)]
    learner, _, _ = await _run(tmp_path, groups, wait_for_consumed=6, prometheus=prometheus, tracker=tracker)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve_metrics(port, prometheus.registry, "127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = {(m.name, tuple(sorted(m.labels.items()))): m.value for f in text_string_to_metric_families(text) for m in f.samples}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["loss"] is not None]
    assert got[("conveyor_learner_step", ())] == learner.step == 2
    assert got[("conveyor_learner_policy_version", ())] == learner.version == 2
    assert got[("conveyor_learner_trained_samples_total", ())] == sum(r["trained_samples"] for r in rows) == 4
    assert got[("conveyor_learner_trained_tokens_total", ())] == sum(r["tokens"] for r in trained)
    assert got[("conveyor_learner_reward_mean", ())] == rows[-1]["reward_mean"]
    assert got[("conveyor_learner_pass_rate", ())] == rows[-1]["pass_rate"]
    assert got[("conveyor_learner_grad_norm", ())] == trained[-1]["grad_norm"]
    assert got[("conveyor_learner_events_total", (("reason", "batches_untrained"),))] == 1
    assert got[("conveyor_learner_events_total", (("reason", "samples_zero_variance"),))] == 2
    # Every sample of every step, trained or not, in the staleness histogram.
    assert got[("conveyor_learner_sample_staleness_versions_count", ())] == 6
    assert got[("conveyor_learner_step_seconds_count", ())] == len(rows) == 3
    for phase, column in (("wait", "wait_s"), ("compute", "step_s"), ("publish", "publish_s")):  # the step's time split
        assert got[("conveyor_learner_phase_seconds_total", (("phase", phase),))] == pytest.approx(sum(r[column] for r in rows))
    # The same rows in the experiment tracker, and where the final policy is.
    events = EventAccumulator(str(tmp_path / "tb" / "ver"), size_guidance={"tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (r["step"], pytest.approx(r["reward_mean"])) for r in rows
    ]
    model = events.Tensors("model/text_summary")[0].tensor_proto.string_val[0].decode()
    assert model == learner.store.uri(learner.published_key)
