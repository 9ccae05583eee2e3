"""Task producer with admission credits.

Publishes tasks from an iterator only while the samples offered on the run's
admission ledger (``conveyor/admission.py``) and not yet claimed by any rollout
worker stay within one learner batch: the tasks topic holds enough to refill
the workers as the learner consumes, and no more, however many producers run
and after any restart (the ledger, not this process, holds the count). After
publishing, the producer appends an *offer* of what it published; a crash
between the two only leaves tasks un-offered, which never holds a producer
back. Staleness itself is bounded where generation starts, by the workers'
tickets.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Iterator

import structlog

from conveyor import keys
from conveyor.admission import AdmissionLedger
from conveyor.contracts import ScoredRollout, Task, attempt_key
from conveyor.messaging import ClaimCheck, Publisher, ServiceClients
from conveyor.topics import Topics
from conveyor.tracing import headers_of, tracer
from conveyor.transport.base import CommitFailed, Transport

log = structlog.get_logger(__name__)


class TaskProducer:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        tasks: Iterator[Task],
        *,
        learner_batch_samples: int,
        store=None,
        curriculum=None,
        claim_check: ClaimCheck | None = None,
    ) -> None:
        self.claim_check = claim_check  # messages over its threshold travel through the object store
        self.transport = transport
        self.topics = topics
        self.tasks = tasks
        self.learner_batch_samples = learner_batch_samples
        self.ledger: AdmissionLedger | None = None
        # With an object store, the stream's position survives a restart (a deterministic stream
        # would otherwise be republished from the start: duplicates, absorbed downstream, but wasted).
        self.store = store if curriculum is None else None  # a curriculum's order is not a replayable position
        self.curriculum = curriculum  # producers.curriculum.Curriculum: fed the scored groups
        self._group_rewards: dict[tuple[str, int], list[float]] = {}
        self._position_key = keys.producer_position_key(topics.run_id)
        self.position = 0
        self._saved_at = 0.0

    def _resume_position(self) -> int:
        """How many tasks of the stream a previous incarnation published (its saved position)."""
        if self.store is None:
            return 0
        import json

        from conveyor.objectstore import ObjectNotFound

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
        """Samples that may still be offered: one learner batch, less what is offered and unclaimed."""
        assert self.ledger is not None
        return self.learner_batch_samples - self.ledger.unclaimed_offered

    async def run(self, stop: asyncio.Event) -> None:
        async with ServiceClients(
            self.transport, self.topics.dead_letter, "producer", heartbeats=self.topics, claim_check=self.claim_check
        ) as io:
            pub: Publisher[Task] = io.publisher(self.topics.tasks)
            self.ledger = await AdmissionLedger.open(io, self.topics, f"producer-{uuid.uuid4().hex[:8]}")
            await self.ledger.catch_up()
            scored = None
            if self.curriculum is not None:
                scored = await io.subscribe([self.topics.scored], self.topics.group("producer-curriculum"), ScoredRollout)
            self.position = await asyncio.to_thread(self._resume_position)
            if self.position:
                self.tasks = itertools.islice(self.tasks, self.position, None)
            while not stop.is_set():
                if self.store is not None and time.monotonic() - self._saved_at > 1.0:
                    await asyncio.to_thread(self._save_position)
                    self._saved_at = time.monotonic()
                await self.ledger.follow(wait_s=0.1)
                if scored is not None:
                    got = await scored.poll(timeout_s=0, max_records=4096)
                    self._feed_curriculum([d.message for d in got])
                    try:
                        await scored.commit(got)
                    except CommitFailed as exc:  # rebalanced away: the curriculum only hears a verdict twice
                        log.warning("producer.commit_after_rebalance", error=str(exc)[:200])
                offered: list[tuple[str, int]] = []
                try:
                    while self.credits() - sum(n for _, n in offered) > 0 and not stop.is_set():
                        task = next(self.tasks, None)
                        if task is None:
                            await asyncio.to_thread(self._save_position)
                            return
                        # A trace starts here (sampled by tracing.sample_ratio): the task's record carries it on.
                        with tracer().start_as_current_span("submit", attributes=_attributes(task)) as span:
                            await pub.publish_and_wait(task, key=task.task_id, headers=headers_of(span))
                        offered.append((attempt_key(task.task_id, task.attempt), task.group_size))
                        self.position += 1
                finally:
                    await self.ledger.offer(offered)
            await asyncio.to_thread(self._save_position)  # a clean stop resumes exactly here


def _attributes(task: Task) -> dict:
    return {"conveyor.run_id": task.run_id, "conveyor.task_id": task.task_id, "conveyor.attempt": task.attempt,
            "conveyor.group_size": task.group_size, "conveyor.verifier": task.verifier.kind}  # fmt: skip
