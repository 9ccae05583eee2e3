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

from bench.tracing import GROUP, pipeline
from conveyor.objectstore import open_object_store
from conveyor.observability_config import TracingConfig
from conveyor.topics import Topics
from conveyor.tracing import configure_tracing, reset_tracing
from conveyor.transport import open_transport
from tasks.suites.pyexpr import sample_problems, to_task
from tests.conftest import open_sandbox

pytestmark = pytest.mark.integration

TASKS, RATIO = 16, 0.5
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
    problems = sample_problems(random.Random(3))
    tasks = [to_task(next(problems), run_id, GROUP, i) for i in range(TASKS)]
    services = pipeline(transport, store, topics, tmp_path, iter(tasks), open_sandbox(parallel=2))
    learner, sink = services["learner"], services["storage-sink"]
    stop = asyncio.Event()
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
        # one generate for the task's group, a score per sample; the group trained in one step (a
        # train span) and stored by one flush or two (a store span each), under its score spans
        assert len(names["generate"]) == 1 and names["generate"][0].attributes["conveyor.task_id"] == task_id, names
        counts = {k: len(v) for k, v in names.items()}
        assert len(names["score"]) == GROUP and len(names["train"]) == 1 and names["store"], counts
        rows = sum(s.attributes["conveyor.rows"] for s in names["store"])
        assert names["train"][0].attributes["conveyor.samples"] == rows == GROUP
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
