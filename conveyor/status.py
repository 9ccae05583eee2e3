"""``conveyor status``: a run's health from the outside, read from the broker and the object store.

Per consumer group: members alive and the lag of each topic it reads
(end offset − committed offset, summed over partitions); the learner's
progress (policy version, samples consumed, step) from the progress topic;
the newest announced weights; the lake's size; throughput measured over a
short window (samples consumed per second).
"""

from __future__ import annotations

import asyncio
import time

from conveyor.config import RunConfig
from conveyor.contracts import DecodeError, LearnerProgress, WeightsAnnouncement, decode
from conveyor.topics import Topics

GROUPS = {
    "rollout-workers": "tasks",
    "reward-bridge": "rollouts",
    "learner": "scored",
    "storage-sink": "scored",
}


async def _latest(transport, topic: str, typ):
    consumer = transport.consumer([topic], f"status-{int(time.time() * 1000)}")
    await consumer.start()
    latest = None
    try:
        for _ in range(3):
            for rec in await consumer.getmany(timeout_s=0.3, max_records=100_000):
                try:
                    latest = decode(rec.value, typ)
                except DecodeError:  # dead-lettered by the services; not status
                    continue
    finally:
        await consumer.close()
    return latest


async def kafka_lag(cfg: RunConfig) -> dict:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    topics = Topics(cfg.run_id)
    servers = cfg.transport.bootstrap_servers
    probe = AIOKafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)
    await probe.start()
    out: dict = {}
    try:
        await probe.topics()
        for group, short in GROUPS.items():
            topic = getattr(topics, short)
            tps = [TopicPartition(topic, p) for p in sorted(probe.partitions_for_topic(topic) or ())]
            ends = await probe.end_offsets(tps) if tps else {}
            # The group's committed offsets, read without joining it (OffsetFetch through a consumer
            # of that group id that never subscribes).
            reader = AIOKafkaConsumer(bootstrap_servers=servers, group_id=group, enable_auto_commit=False)
            await reader.start()
            try:
                committed = {tp: await reader.committed(tp) for tp in tps}
            finally:
                await reader.stop()
            # tansu answers ListOffsets(latest) with the last *batch's* base offset + 1, short of
            # the end when producers batch; a fetch's high watermark is right on every broker.
            marks = await _high_watermarks(servers, tps, committed)
            ends = {tp: max(v for v in (ends.get(tp), marks.get(tp), 0) if v is not None) for tp in tps}
            lag = sum(max(0, ends[tp] - (committed[tp] or 0)) for tp in tps)
            out[group] = {"topic": topic, "lag": int(lag), "members": await _members(servers, group)}
    finally:
        await probe.stop()
    return out


async def _high_watermarks(servers: str, tps: list, start: dict) -> dict:
    """Each partition's high watermark, from a fetch at the group's committed offset (nothing
    is committed: no group)."""
    from aiokafka import AIOKafkaConsumer

    if not tps:
        return {}
    consumer = AIOKafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, start.get(tp) or 0)
        for _ in range(3):
            await consumer.getmany(timeout_ms=300, max_records=1)
            if all(consumer.highwater(tp) is not None for tp in tps):
                break
        return {tp: consumer.highwater(tp) for tp in tps}
    finally:
        await consumer.stop()


async def _members(servers: str, group: str) -> int | None:
    """Members alive in a group (DescribeGroups); None where the broker does not answer it."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=servers, request_timeout_ms=3000)
    try:
        await admin.start()
        desc = await asyncio.wait_for(admin.describe_consumer_groups([group]), 5)
        return sum(len(d.members) for d in desc)
    except Exception:  # noqa: BLE001 - e.g. tansu closes the connection on DescribeGroups
        return None
    finally:
        await admin.close()


async def collect(cfg: RunConfig, window_s: float = 2.0) -> dict:
    from conveyor.transport import open_transport
    from storage.lake import LakeReader
    from storage.objectstore import open_object_store

    transport = open_transport(cfg.transport)
    topics = Topics(cfg.run_id)
    try:
        first = await _latest(transport, topics.progress, LearnerProgress)
        await asyncio.sleep(window_s)
        progress = await _latest(transport, topics.progress, LearnerProgress)
        weights = await _latest(transport, topics.weights, WeightsAnnouncement)
    finally:
        await transport.close()
    rate = None
    if first is not None and progress is not None:
        rate = (progress.samples_consumed - first.samples_consumed) / window_s
    status = {
        "run_id": cfg.run_id,
        "learner": None if progress is None else {"policy_version": progress.policy_version,
                                                  "samples_consumed": progress.samples_consumed, "step": progress.step},  # fmt: skip
        "weights": None if weights is None else {"version": weights.version, "uri": weights.uri},
        "samples_per_s": rate,
    }
    if cfg.transport.type == "kafka":
        status["groups"] = await kafka_lag(cfg)
    store = await asyncio.to_thread(open_object_store, cfg.object_store)
    status["lake"] = await asyncio.to_thread(LakeReader(store, cfg.run_id).stats)
    return status
