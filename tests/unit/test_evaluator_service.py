"""The evaluator service follows the weights topic and evaluates every ``every`` versions (and the
starting policy), writing the held-out curve to eval.jsonl and the object store."""

from __future__ import annotations

import asyncio
import json

import pytest

from conveyor import keys
from conveyor.config import RolloutConfig
from conveyor.contracts import Task, VerifierSpec, WeightsAnnouncement
from conveyor.messaging import Publisher
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from learner.models import create_tiny_llama
from rollout_workers.engines import open_engine
from rollout_workers.evaluator import EvaluatorService

ALPHABET = "0123456789+-*() =\n"


async def test_every_kth_version_is_evaluated(tmp_path):
    from safetensors.torch import save

    model, _ = create_tiny_llama(tmp_path / "m", ALPHABET, hidden_size=32, layers=1, intermediate_size=64)
    store = LocalObjectStore(tmp_path / "objects")
    transport, topics = MemoryTransport(), Topics("ev")
    await transport.create_topics(topics.specs(1))
    producer = transport.producer()
    await producer.start()
    announce = Publisher(producer, topics.weights)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tasks = [Task(task_id=f"h{i}", run_id="ev", prompt=f"{i}+1=", verifier=VerifierSpec(kind="math", data={"answer": str(i + 1)}))
             for i in range(4)]  # fmt: skip
    from conveyor.tracking import TensorBoardBackend, Tracker

    tracker = Tracker(TensorBoardBackend(tmp_path / "tb"))
    tracker.start("ev-eval", {"eval": {"every": 2}})
    service = EvaluatorService(transport, topics, store, open_engine(RolloutConfig(seed=0), tmp_path / "m"), None, tasks,
                               every=2, run_dir=tmp_path, k=2, samples=2, max_tokens=4, tracker=tracker)  # fmt: skip
    stop = asyncio.Event()
    run = asyncio.create_task(service.run(stop))
    for version in (1, 2, 3):
        key = keys.weights_key("ev", version)
        info = store.put(key, save(state))
        await announce.publish_and_wait(WeightsAnnouncement(run_id="ev", version=version, key=key, uri=store.uri(key),
                                                            sha256=info.sha256, step=version), key="ev")  # fmt: skip
        if version == 2:
            for _ in range(200):
                if service.evaluated == 2:
                    break
                await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.wait_for(run, 30)
    await producer.close()
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [0, 2]  # the start, then every second version (3 is not due)
    assert all(r["tasks"] == 4 and r["k"] == 2 and 0.0 <= r["pass_rate"] <= r["pass_at_k"] <= 1.0 for r in rows)
    stored = store.get(keys.meta_key("ev", "eval.jsonl")).decode().splitlines()
    assert [json.loads(line)["version"] for line in stored] == [0, 2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "ev-eval"))
    events.Reload()  # the same rows in the tracker, at their versions (the service closed it)
    assert [(e.step, e.value) for e in events.Scalars("eval/pass_rate")] == [
        (r["version"], pytest.approx(r["pass_rate"])) for r in rows
    ]
