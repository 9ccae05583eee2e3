"""Rollout worker: tasks topic -> engine -> rollouts topic.

- Admission control: a batch of tasks starts only while
  ``generated + batch - consumed <= (max_lag + 1) * learner_batch`` samples,
  with ``consumed`` read from the learner's progress topic. The worker never
  runs more than ``max_lag`` versions ahead of what the learner can use.
- Weight swaps: announcements on the weights topic are applied between
  engine batches: the safetensors object is fetched from the object store,
  its sha256 checked, and loaded; every rollout records the version that
  produced it.
- Offsets of the tasks topic are committed only after the batch's rollouts
  were acknowledged by the broker; a crash regenerates the batch under the
  same deterministic ``rollout_id`` values.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog

from conveyor.contracts import (
    LearnerProgress,
    Rollout,
    Task,
    Timings,
    VersionSegment,
    WeightsAnnouncement,
    rollout_id,
)
from conveyor.messaging import Publisher, ServiceClients, Subscriber
from conveyor.topics import Topics
from conveyor.transport.base import Transport
from storage.objectstore import ObjectStore

log = structlog.get_logger(__name__)


class RolloutWorker:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        engine,
        store: ObjectStore,
        *,
        learner_batch_samples: int,
        max_lag: int = 1,
        tasks_per_batch: int = 16,
        group_id: str = "rollout-workers",
    ) -> None:
        self.transport = transport
        self.topics = topics
        self.engine = engine
        self.store = store
        self.learner_batch_samples = learner_batch_samples
        self.max_lag = max_lag
        self.tasks_per_batch = tasks_per_batch
        self.group_id = group_id
        self.worker_id = uuid.uuid4().hex[:8]
        self.generated = 0
        self.consumed = 0
        self.tokens = 0
        self.swaps = 0

    def admitted(self, batch_samples: int) -> bool:
        return self.generated + batch_samples - self.consumed <= (self.max_lag + 1) * self.learner_batch_samples

    async def run(self, stop: asyncio.Event) -> None:
        async with ServiceClients(self.transport, self.topics.dead_letter, "rollout-worker") as io:
            publisher: Publisher[Rollout] = io.publisher(self.topics.rollouts)
            tasks = await io.subscribe([self.topics.tasks], self.group_id, Task)
            # Every worker sees every announcement and progress report: a group of its own.
            weights = await io.subscribe([self.topics.weights], f"rw-weights-{self.worker_id}", WeightsAnnouncement)
            progress = await io.subscribe([self.topics.progress], f"rw-progress-{self.worker_id}", LearnerProgress)
            pending: list = []
            while not stop.is_set():
                await self._follow(weights, progress)
                if not pending:
                    pending = await tasks.poll(timeout_s=0.2, max_records=self.tasks_per_batch)
                if not pending:
                    continue
                samples = sum(d.message.group_size for d in pending)
                if not self.admitted(samples):
                    await asyncio.sleep(0.02)
                    continue
                rollouts = await asyncio.to_thread(self._generate, [d.message for d in pending])
                futures = [await publisher.publish(r, r.task_id) for r in rollouts]
                await asyncio.gather(*futures)
                await tasks.commit(pending)
                self.generated += len(rollouts)
                pending = []

    async def _follow(self, weights: Subscriber, progress: Subscriber) -> None:
        for d in await progress.poll(timeout_s=0, max_records=1000):
            self.consumed = max(self.consumed, d.message.samples_consumed)
        newest = None
        for d in await weights.poll(timeout_s=0, max_records=1000):
            if newest is None or d.message.version > newest.version:
                newest = d.message
        if newest is not None and newest.version > self.engine.version:
            await asyncio.to_thread(self._swap, newest)

    def _swap(self, ann: WeightsAnnouncement) -> None:
        from safetensors.torch import load

        state = load(self.store.get(ann.key, sha256=ann.sha256))
        self.engine.load_state_dict(state, ann.version)
        self.swaps += 1

    def _generate(self, tasks: list[Task]) -> list[Rollout]:
        start = time.time()
        by_size: dict[tuple, list[Task]] = {}
        for t in tasks:
            sp = t.sampling
            key = (t.group_size, sp.max_tokens if sp else 16, sp.temperature if sp else 1.0, tuple(sp.stop) if sp else ())
            by_size.setdefault(key, []).append(t)
        out: list[Rollout] = []
        for (n, max_tokens, temperature, stop_strings), group in by_size.items():
            prompts = [self.engine.encode_prompt(t.prompt, t.messages) for t in group]
            stop_ids = {ids[0] for s in stop_strings if len(ids := self.engine.encode(s)) == 1}
            results = self.engine.generate(
                prompts, n, max_new_tokens=max_tokens, temperature=temperature, stop_token_ids=stop_ids
            )
            finished = time.time()
            for task, prompt, completions in zip(group, prompts, results):
                for i, c in enumerate(completions):
                    self.tokens += len(c.token_ids)
                    out.append(
                        Rollout(
                            rollout_id=rollout_id(task.task_id, i, task.attempt),
                            task_id=task.task_id,
                            run_id=task.run_id,
                            sample_index=i,
                            attempt=task.attempt,
                            group_size=n,
                            prompt_token_ids=prompt,
                            completion_token_ids=c.token_ids,
                            behaviour_logprobs=c.logprobs,
                            loss_mask=[1] * len(c.token_ids),
                            version_segments=[VersionSegment(start=0, end=len(c.token_ids), policy_version=c.policy_version)],
                            finish_reason=c.finish_reason,  # type: ignore[arg-type]
                            timings=Timings(generation_started_at=start, generation_finished_at=finished),
                            task=task,
                        )
                    )
        return out
