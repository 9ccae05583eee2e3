"""Task producer with admission credits.

Publishes tasks from an iterator only while the pipeline has room:
``published_samples - consumed_samples <= (max_lag + 2) * learner_batch``,
with ``consumed_samples`` from the learner's progress topic. The tasks topic
therefore never fills with work that would be stale by the time it is
generated; the rollout workers' own admission control does the fine-grained
part.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Iterator

import structlog

from conveyor.contracts import LearnerProgress, ScoredRollout, Task
from conveyor.messaging import Publisher, ServiceClients
from conveyor.topics import Topics
from conveyor.transport.base import Transport

log = structlog.get_logger(__name__)


class TaskProducer:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        tasks: Iterator[Task],
        *,
        learner_batch_samples: int,
        max_lag: int = 1,
        store=None,
        curriculum=None,
    ) -> None:
        self.transport = transport
        self.topics = topics
        self.tasks = tasks
        self.learner_batch_samples = learner_batch_samples
        self.max_lag = max_lag
        self.published_samples = 0
        self.consumed_samples = 0
        # With an object store, the stream's position survives a restart (a deterministic stream
        # would otherwise be republished from the start: duplicates, absorbed downstream, but wasted).
        self.store = store if curriculum is None else None  # a curriculum's order is not a replayable position
        self.curriculum = curriculum  # producers.curriculum.Curriculum: fed the scored groups
        self._group_rewards: dict[tuple[str, int], list[float]] = {}
        self._position_key = f"runs/{topics.run_id}/producer/position.json"
        self.position = 0
        self._saved_at = 0.0

    def _resume_position(self) -> int:
        """How many tasks of the stream a previous incarnation published (its saved position)."""
        if self.store is None:
            return 0
        import json

        from storage.objectstore import ObjectNotFound

        try:
            return int(json.loads(self.store.get(self._position_key))["tasks"])
        except ObjectNotFound:
            return 0
        # ObjectStoreUnavailable propagates: the service exits and is restarted (no guessing a position)

    def _save_position(self) -> None:
        """Best effort: a position not saved only means some tasks are published again after a
        restart (duplicates are absorbed downstream); an object-store outage must not stop the stream."""
        import json

        from conveyor.errors import RetryableError

        if self.store is not None:
            try:
                self.store.put(self._position_key, json.dumps({"tasks": self.position}).encode())
            except RetryableError as exc:
                log.warning("producer.position_not_saved", position=self.position, error=str(exc)[:200])

    def _feed_curriculum(self, rows: list[ScoredRollout]) -> None:
        """Complete groups (all samples of one attempt of a task) go to the curriculum."""
        for s in rows:
            r = s.rollout
            key = (r.task_id, r.attempt)
            rewards = self._group_rewards.setdefault(key, [])
            rewards.append(s.reward)
            if len(rewards) >= r.group_size:
                self.curriculum.record(r.task_id, rewards)
                del self._group_rewards[key]

    def credits(self) -> int:
        return (self.max_lag + 2) * self.learner_batch_samples - (self.published_samples - self.consumed_samples)

    async def run(self, stop: asyncio.Event) -> None:
        async with ServiceClients(self.transport, self.topics.dead_letter, "producer", heartbeats=self.topics) as io:
            pub: Publisher[Task] = io.publisher(self.topics.tasks)
            progress = await io.subscribe([self.topics.progress], f"producer-progress-{uuid.uuid4().hex[:8]}", LearnerProgress)
            scored = None
            if self.curriculum is not None:
                scored = await io.subscribe([self.topics.scored], "producer-curriculum", ScoredRollout)
            self.position = await asyncio.to_thread(self._resume_position)
            if self.position:
                self.tasks = itertools.islice(self.tasks, self.position, None)
            while not stop.is_set():
                if self.store is not None and time.monotonic() - self._saved_at > 1.0:
                    await asyncio.to_thread(self._save_position)
                    self._saved_at = time.monotonic()
                for d in await progress.poll(timeout_s=0.1, max_records=1000):
                    self.consumed_samples = max(self.consumed_samples, d.message.samples_consumed)
                if scored is not None:
                    got = await scored.poll(timeout_s=0, max_records=4096)
                    self._feed_curriculum([d.message for d in got])
                    await scored.commit(got)
                while self.credits() > 0 and not stop.is_set():
                    task = next(self.tasks, None)
                    if task is None:
                        await asyncio.to_thread(self._save_position)
                        return
                    await pub.publish_and_wait(task, key=task.task_id)
                    self.published_samples += task.group_size
                    self.position += 1
            await asyncio.to_thread(self._save_position)  # a clean stop resumes exactly here
