"""The storage sink under failure, against the real broker and SeaweedFS:
S3 stopped for 30 s mid-run, and a sink killed with SIGKILL after writing a
data file but before the table commit, or after the table commit but before
Kafka's. Every rollout ends up in the rollouts table once, as a foreign
reader (Polars, through the Delta log) counts it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml
from integration.test_lake import foreign_count
from unit.test_lake_codec import scored

from conveyor.config import SinkConfig
from conveyor.contracts import ScoredRollout
from conveyor.messaging import Publisher
from conveyor.objectstore import S3ObjectStore
from conveyor.topics import Topics
from storage.lake import LakeReader


def make_rows(run_id: str, lo: int, hi: int) -> list[ScoredRollout]:
    out = []
    for i in range(lo, hi):
        s = scored(i, n=200)
        r = s.rollout.__class__(**{f: getattr(s.rollout, f) for f in s.rollout.__struct_fields__ if f not in ("rollout_id", "run_id")},
                                rollout_id=f"{run_id}-{i}", run_id=run_id)  # fmt: skip
        out.append(ScoredRollout(rollout=r, reward=s.reward, verdict=s.verdict, completion_text=s.completion_text))
    return out


async def publish(transport, topic: str, rows, per_batch: int = 10, every_s: float = 0.0):
    producer = transport.producer()
    await producer.start()
    pub = Publisher(producer, topic)
    try:
        for i in range(0, len(rows), per_batch):
            await asyncio.gather(*[await pub.publish(r, r.rollout.task_id) for r in rows[i : i + per_batch]])
            if every_s:
                await asyncio.sleep(every_s)
    finally:
        await producer.close()


def lake_ids(store, run_id):
    return [s.rollout_id for s in LakeReader(store, run_id).iter()]


def test_s3_down_for_30_seconds_loses_and_duplicates_nothing(stack, kafka_cfg, s3_cfg):
    from conveyor.transport.kafka import KafkaTransport
    from storage.sink import StorageSink

    run_id = f"outage-{uuid.uuid4().hex[:6]}"
    topics = Topics(run_id)
    store = S3ObjectStore(s3_cfg.model_copy(update={"prefix": f"{run_id}/", "max_attempts": 2, "connect_timeout_s": 1.0}))
    rows = make_rows(run_id, 0, 400)

    async def scenario():
        transport = KafkaTransport(kafka_cfg)
        await transport.create_topics(topics.specs(kafka_cfg.partitions))
        sink = StorageSink(transport, topics, store, SinkConfig(flush_rows=40, flush_s=0.5, backoff_max_s=2.0))
        stop = asyncio.Event()
        run = asyncio.create_task(sink.run(stop))
        producing = asyncio.create_task(publish(transport, topics.scored, rows, per_batch=10, every_s=1.0))
        await asyncio.sleep(5)
        await asyncio.to_thread(stack.kill, "s3")
        down_at = time.monotonic()
        await asyncio.sleep(30)
        await asyncio.to_thread(stack.restart, "s3", 60.0)
        outage_s = time.monotonic() - down_at
        await producing
        stop.set()
        await asyncio.wait_for(run, timeout=120)
        await transport.close()
        return sink, outage_s

    sink, outage_s = asyncio.run(scenario())
    assert outage_s >= 30 and sink.retries > 0
    ids = lake_ids(store, run_id)
    assert sorted(ids) == sorted(r.rollout_id for r in rows)
    assert foreign_count(store, run_id) == (len(rows), len(rows)), "a row is in the table twice"


@pytest.mark.parametrize("failpoint", ["sink_before_table_commit", "sink_before_kafka_commit"])
def test_sink_killed_between_write_and_commit_leaves_each_rollout_once(stack, kafka_cfg, s3_cfg, tmp_path, failpoint):
    from conveyor.transport.kafka import KafkaTransport

    run_id = f"sigkill-{uuid.uuid4().hex[:6]}"
    prefix = f"{run_id}/"
    cfg = {
        "run_id": run_id,
        "transport": kafka_cfg.model_dump(),
        "object_store": {
            **s3_cfg.model_dump(mode="json"),
            "prefix": prefix,
            "secret_access_key": s3_cfg.secret_access_key.get_secret_value(),
        },  # fmt: skip
        "logging": {"level": "info", "format": "json"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    store = S3ObjectStore(s3_cfg.model_copy(update={"prefix": prefix}))
    topics = Topics(run_id)
    first, second = make_rows(run_id, 0, 100), make_rows(run_id, 100, 150)

    async def pub(rows):
        transport = KafkaTransport(kafka_cfg)
        await transport.create_topics(topics.specs(kafka_cfg.partitions))
        await publish(transport, topics.scored, rows, per_batch=50)
        await transport.close()

    def sink(env_extra):
        return subprocess.Popen(
            [sys.executable, "-m", "launch.cli.main", "serve", "storage-sink", "--config", str(path), "--flush-rows", "40", "--flush-s", "0.5"],
            env={**os.environ, **env_extra}, stdout=(tmp_path / "sink.log").open("a"), stderr=subprocess.STDOUT,
        )  # fmt: skip

    asyncio.run(pub(first))
    crashed = sink({"CONVEYOR_FAILPOINT": failpoint})
    assert crashed.wait(120) == -signal.SIGKILL, (tmp_path / "sink.log").read_text()[-2000:]
    data_files = [o.key for o in store.list(f"runs/{run_id}/rollouts/part-")]
    committed = LakeReader(store, run_id).parts()
    assert len(data_files) == 1  # it wrote one file, then died
    assert len(committed) == (0 if failpoint == "sink_before_table_commit" else 1)  # ... before or after the table commit
    asyncio.run(pub(second))
    survivor = sink({})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(set(lake_ids(store, run_id))) < 150:
            time.sleep(1)
    finally:
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(60) == 0, (tmp_path / "sink.log").read_text()[-2000:]
    ids = lake_ids(store, run_id)
    rows, distinct = foreign_count(store, run_id)
    print(f"FIGURE lake_foreign_duplicates {rows - distinct} rows ({failpoint}; {rows} rows read by Polars)")
    assert len(ids) == len(set(ids)) == 150 and (rows, distinct) == (150, 150)
    assert sorted(ids) == sorted(r.rollout_id for r in first + second)


def test_sink_started_while_s3_is_down_waits_for_it(stack, kafka_cfg, s3_cfg, tmp_path):
    """A service started during an S3 outage waits for the endpoint (``object_store.waiting``)
    instead of exiting, and stores what was published once S3 is back."""
    from conveyor.transport.kafka import KafkaTransport

    run_id = f"late-s3-{uuid.uuid4().hex[:6]}"
    prefix = f"{run_id}/"
    cfg = {
        "run_id": run_id,
        "transport": kafka_cfg.model_dump(),
        "object_store": {
            **s3_cfg.model_dump(mode="json"),
            "prefix": prefix,
            "max_attempts": 1,
            "connect_timeout_s": 1.0,
            "connect_deadline_s": 90,
            "secret_access_key": s3_cfg.secret_access_key.get_secret_value(),
        },  # fmt: skip
        "logging": {"level": "info", "format": "json"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = make_rows(run_id, 0, 60)

    async def pub():
        transport = KafkaTransport(kafka_cfg)
        await transport.create_topics(Topics(run_id).specs(kafka_cfg.partitions))
        await publish(transport, Topics(run_id).scored, rows, per_batch=30)
        await transport.close()

    asyncio.run(pub())
    log = tmp_path / "sink.log"
    stack.kill("s3")
    sink = subprocess.Popen(
        [sys.executable, "-m", "launch.cli.main", "serve", "storage-sink", "--config", str(path), "--flush-rows", "40", "--flush-s", "0.5"],
        stdout=log.open("a"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and log.read_text().count("object_store.waiting") < 2:
            time.sleep(0.2)
        assert sink.poll() is None and log.read_text().count("object_store.waiting") >= 2, log.read_text()[-2000:]
        stack.restart("s3", 60.0)
        store = S3ObjectStore(s3_cfg.model_copy(update={"prefix": prefix}))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(set(lake_ids(store, run_id))) < len(rows):
            time.sleep(1)
    finally:
        stack.ensure_healthy("s3")
        sink.send_signal(signal.SIGTERM)
        rc = sink.wait(60)
    assert rc == 0, log.read_text()[-2000:]
    assert sorted(lake_ids(store, run_id)) == sorted(r.rollout_id for r in rows)
