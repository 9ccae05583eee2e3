"""Storage sink: scored topic -> Parquet objects in the trajectory lake.

Its own consumer group on the scored topic. Rows are buffered and flushed
by count or age; each flush writes one Parquet object whose name is the
hash of its rows' ids, under ``runs/<run>/lake/policy_version=<v>/``, with
put-if-absent. Offsets are committed only after the object store confirmed
the write: a crash re-reads and rewrites the same object (same name, same
content), so the lake never holds a row twice from a replay of the same
batch. (The full lake — manifest, replay, S3 outage handling — is issue #7.)
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import time

import structlog

from conveyor.contracts import ScoredRollout
from conveyor.messaging import ServiceClients
from conveyor.topics import Topics
from conveyor.transport.base import Transport
from storage.objectstore import ObjectStore

log = structlog.get_logger(__name__)


def rows_to_parquet(rows: list[ScoredRollout]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "rollout_id": pa.array([r.rollout.rollout_id for r in rows], pa.string()),
            "run_id": pa.array([r.rollout.run_id for r in rows], pa.string()),
            "task_id": pa.array([r.rollout.task_id for r in rows], pa.string()),
            "sample_index": pa.array([r.rollout.sample_index for r in rows], pa.int32()),
            "policy_version": pa.array([r.rollout.min_policy_version for r in rows], pa.int32()),
            "reward": pa.array([r.reward for r in rows], pa.float32()),
            "verdict": pa.array([r.verdict for r in rows], pa.string()),
            "prompt": pa.array([r.rollout.task.prompt if r.rollout.task else None for r in rows], pa.string()),
            "prompt_token_ids": pa.array([r.rollout.prompt_token_ids.tolist() for r in rows], pa.list_(pa.int32())),
            "completion_token_ids": pa.array([r.rollout.completion_token_ids.tolist() for r in rows], pa.list_(pa.int32())),
            "behaviour_logprobs": pa.array([r.rollout.behaviour_logprobs.tolist() for r in rows], pa.list_(pa.float32())),
            "finish_reason": pa.array([r.rollout.finish_reason for r in rows], pa.string()),
            "generated_at": pa.array([r.rollout.timings.generation_finished_at for r in rows], pa.float64()),
            "scored_at": pa.array([r.scored_at for r in rows], pa.float64()),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


class StorageSink:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        store: ObjectStore,
        *,
        flush_rows: int = 512,
        flush_s: float = 5.0,
        group_id: str = "storage-sink",
    ) -> None:
        self.transport = transport
        self.topics = topics
        self.store = store
        self.flush_rows = flush_rows
        self.flush_s = flush_s
        self.group_id = group_id
        self.rows_written = 0
        self.objects: list[str] = []

    async def run(self, stop: asyncio.Event) -> None:
        async with ServiceClients(self.transport, self.topics.dead_letter, "storage-sink") as io:
            sub = await io.subscribe([self.topics.scored], self.group_id, ScoredRollout)
            buffer = []
            oldest = time.monotonic()
            while True:
                stopping = stop.is_set()
                got = await sub.poll(timeout_s=0.2, max_records=1024)
                if got and not buffer:
                    oldest = time.monotonic()
                buffer.extend(got)
                due = len(buffer) >= self.flush_rows or (buffer and time.monotonic() - oldest >= self.flush_s)
                if buffer and (due or (stopping and not got)):
                    await self._flush([d.message for d in buffer])
                    await sub.commit(buffer)
                    buffer = []
                if stopping and not got and not buffer:
                    return

    async def _flush(self, rows: list[ScoredRollout]) -> None:
        # One row per rollout id (a redelivered rollout is the same rollout).
        unique = {r.rollout_id: r for r in rows}.values()
        by_version: dict[int, list[ScoredRollout]] = {}
        for r in unique:
            by_version.setdefault(r.rollout.min_policy_version, []).append(r)
        for version, group in sorted(by_version.items()):
            group.sort(key=lambda r: r.rollout_id)
            digest = hashlib.sha256("\n".join(r.rollout_id for r in group).encode()).hexdigest()[:24]
            key = f"runs/{self.topics.run_id}/lake/policy_version={version}/part-{digest}.parquet"
            data = await asyncio.to_thread(rows_to_parquet, group)
            await asyncio.to_thread(self.store.put_if_absent, key, data)
            self.objects.append(key)
            self.rows_written += len(group)
