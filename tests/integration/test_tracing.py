"""One trace per task across the pipeline, on the real Kafka-protocol broker and S3 server: the
producer's submit, the rollout worker's generate, the reward bridge's score, the learner's train
and the storage sink's store spans of a sampled task share its trace id and chain parent to
child, the context travelling in the records' headers. Spans are collected with the
OpenTelemetry SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import defaultdict

import pytest

from conveyor.config import LearnerConfig, SinkConfig
from conveyor.objectstore import open_object_store
from conveyor.observability_config import TracingConfig
from conveyor.topics import Topics
from conveyor.tracing import configure_tracing, reset_tracing
from conveyor.transport import open_transport
from learner.models import create_tiny_llama
from learner.recipe import GRPOLearner
from producers.producer import TaskProducer
from reward.bridge import RewardBridge
from reward.scorers import LocalScorer
from rollout_workers.reference_engine import ReferenceEngine
from rollout_workers.worker import RolloutWorker
from storage.sink import StorageSink
from tasks.suites.pyexpr import ALPHABET, sample_problems, to_task
from tests.conftest import open_sandbox

pytestmark = pytest.mark.integration

GROUP, TASKS, RATIO = 4, 16, 0.5
CHAIN = ("submit", "generate", "score", "train", "store")


@pytest.fixture
def spans():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    configure_tracing(TracingConfig(exporter="none", sample_ratio=RATIO), "pipeline", "trace-test", exporter=exporter)
    yield exporter
    reset_tracing()


async def test_every_sampled_task_is_one_trace_through_five_services(tmp_path, kafka_cfg, s3_cfg, spans):
    run_id = f"trace-{uuid.uuid4().hex[:6]}"
    topics = Topics(run_id)
    transport = open_transport(kafka_cfg)
    store = open_object_store(s3_cfg)
    await transport.create_topics(topics.specs(2))
    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    engine = ReferenceEngine(tmp_path / "m", seed=0)
    problems = sample_problems(random.Random(3))
    tasks = [to_task(next(problems), run_id, GROUP, i) for i in range(TASKS)]
    producer = TaskProducer(transport, topics, iter(tasks), learner_batch_samples=2 * GROUP)
    worker = RolloutWorker(transport, topics, engine, store, learner_batch_samples=2 * GROUP, max_lag=8, tasks_per_batch=4)
    bridge = RewardBridge(transport, topics, LocalScorer(open_sandbox(parallel=2)), engine.decode)
    learner = GRPOLearner(transport, topics, model, tok.pad_token_id, store,
                          LearnerConfig(batch_groups=2, max_lag=8, lr=1e-4, checkpoint_every=0), run_dir=tmp_path)  # fmt: skip
    sink = StorageSink(transport, topics, store, SinkConfig(flush_rows=16, flush_s=0.5))
    stop = asyncio.Event()
    services = {"producer": producer, "rollout-worker": worker, "reward-bridge": bridge, "learner": learner, "storage-sink": sink}
    runs = {name: asyncio.create_task(s.run(stop)) for name, s in services.items()}
    try:
        for _ in range(1800):
            if (learner.samples_consumed >= TASKS * GROUP and sink.rows_written >= TASKS * GROUP) or any(
                r.done() and name != "producer" for name, r in runs.items()
            ):
                break
            await asyncio.sleep(0.1)
        failed = {n: r.exception() for n, r in runs.items() if r.done() and r.exception() is not None}
        assert not failed, failed
    finally:
        stop.set()
        await asyncio.gather(*runs.values(), return_exceptions=True)
        await transport.close()
    assert learner.samples_consumed == sink.rows_written == TASKS * GROUP

    by_trace: dict[int, list] = defaultdict(list)
    for span in spans.get_finished_spans():
        by_trace[span.context.trace_id].append(span)
    submitted = {s.attributes["conveyor.task_id"]: s for t in by_trace.values() for s in t if s.name == "submit"}
    assert 0 < len(submitted) < TASKS  # sampled at the root, by ratio: some tasks traced, some not
    complete = 0
    for task_id, root in submitted.items():
        trace_spans = by_trace[root.context.trace_id]
        names = defaultdict(list)
        for s in trace_spans:
            names[s.name].append(s)
        # one generate for the task's group; a score, a train and a store per sample
        assert len(names["generate"]) == 1 and names["generate"][0].attributes["conveyor.task_id"] == task_id, names
        assert len(names["score"]) == len(names["train"]) == len(names["store"]) == GROUP, {k: len(v) for k, v in names.items()}
        parent = {s.context.span_id: s for s in trace_spans}
        for s in names["store"] + names["train"]:  # store and train hang from score, score from generate, generate from submit
            chain = [s.name]
            while s.parent is not None:
                s = parent[s.parent.span_id]
                chain.append(s.name)
            assert chain[1:] == ["score", "generate", "submit"], chain
        complete += 1
    unsampled = [t.task_id for t in tasks if t.task_id not in submitted]
    assert unsampled and not [s for t in by_trace.values() for s in t if s.attributes.get("conveyor.task_id") in unsampled]
    print(f"traced {complete}/{TASKS} tasks (ratio {RATIO}), {len(spans.get_finished_spans())} spans, each one trace")
