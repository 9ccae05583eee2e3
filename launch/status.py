"""``conveyor status``: a run's health from the outside, read from the broker and the object store.

Per consumer group: the lag of each topic it reads (end offset − committed
offset, summed over partitions) and its members (where the broker answers
DescribeGroups); the service instances alive per role, from the heartbeats
every service publishes (any broker) and, for Celery reward workers, the
workers consuming the run's queue; the learner's progress (policy version, samples consumed,
step, last step's reward and staleness) from the progress topic; the newest
announced weights; the lake's size; throughput measured over a short window
(samples consumed per second).
"""

from __future__ import annotations

import asyncio
import time

from conveyor.config import RunConfig
from conveyor.contracts import DecodeError, Heartbeat, LearnerProgress, WeightsAnnouncement, decode
from conveyor.topics import Topics

GROUPS = {  # role -> the topic its consumer group reads (the group: Topics.group(role))
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
            reader = AIOKafkaConsumer(bootstrap_servers=servers, group_id=topics.group(group), enable_auto_commit=False)
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
            out[group] = {"group": topics.group(group), "topic": topic, "lag": int(lag),
                          "members": await _members(servers, topics.group(group))}  # fmt: skip
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


async def workers_alive(servers: str, topic: str, *, backlog: int = 5000, now: float | None = None) -> dict[str, dict]:
    """Instances per role whose newest heartbeat (among the topic's last ``backlog`` records per
    partition) is younger than three of its intervals (the sender's clock)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)
    await consumer.start()
    newest: dict[tuple[str, str], Heartbeat] = {}
    try:
        await consumer.topics()
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            return {}
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(0, ends[tp] - backlog))
        # Read up to the ends seen at the start (services keep beating while we read), or give up
        # after a few seconds.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any([await consumer.position(tp) < ends[tp] for tp in tps]):
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                for rec in records:
                    try:
                        hb = decode(rec.value, Heartbeat)
                    except DecodeError:
                        continue
                    key = (hb.role, hb.instance)  # the embedded demo runs every role in one process
                    if key not in newest or hb.created_at >= newest[key].created_at:
                        newest[key] = hb
    finally:
        await consumer.stop()
    now = time.time() if now is None else now
    out: dict[str, dict] = {}
    for hb in sorted(newest.values(), key=lambda h: (h.role, h.instance)):
        if now - hb.created_at <= 3 * hb.interval_s:
            role = out.setdefault(hb.role, {"alive": 0, "instances": []})
            role["alive"] += 1
            role["instances"].append(hb.instance)
    return out


def reward_workers_alive(cfg: RunConfig, timeout_s: float = 1.0) -> dict | None:
    """Celery workers that answer on the run's broker and consume the run's reward queue (other
    runs' workers may share the broker); None without a Celery broker."""
    if cfg.celery.type not in ("redis", "rabbitmq"):
        return None
    from reward.celery_app import make_app

    app = make_app(cfg)
    try:
        queues = app.control.inspect(timeout=timeout_s).active_queues() or {}
    finally:
        app.close()
    names = sorted(name for name, qs in queues.items() if any(q.get("name") == cfg.reward.queue for q in qs or []))
    return {"alive": len(names), "instances": names}


async def collect(cfg: RunConfig, window_s: float = 2.0) -> dict:
    from conveyor.objectstore import open_object_store
    from conveyor.transport import open_transport
    from storage.lake import LakeReader

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
        "learner": None
        if progress is None
        else {
            "policy_version": progress.policy_version,
            "samples_consumed": progress.samples_consumed,
            "step": progress.step,
            "reward_mean": progress.reward_mean,
            "max_staleness": progress.max_staleness,
        },  # fmt: skip
        "weights": None if weights is None else {"version": weights.version, "uri": weights.uri},
        "samples_per_s": rate,
    }
    if cfg.transport.type == "kafka":
        status["groups"] = await kafka_lag(cfg)
        status["workers"] = await workers_alive(cfg.transport.bootstrap_servers, topics.heartbeats)
        celery = await asyncio.to_thread(reward_workers_alive, cfg)
        if celery is not None:
            status["workers"]["reward-worker"] = celery
    store = await asyncio.to_thread(open_object_store, cfg.object_store)
    status["lake"] = await asyncio.to_thread(LakeReader(store, cfg.run_id).stats)
    return status
