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
import uuid
from collections.abc import Iterator

from conveyor.contracts import LearnerProgress, Task
from conveyor.messaging import Publisher, ServiceClients
from conveyor.topics import Topics
from conveyor.transport.base import Transport


class TaskProducer:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        tasks: Iterator[Task],
        *,
        learner_batch_samples: int,
        max_lag: int = 1,
    ) -> None:
        self.transport = transport
        self.topics = topics
        self.tasks = tasks
        self.learner_batch_samples = learner_batch_samples
        self.max_lag = max_lag
        self.published_samples = 0
        self.published_tasks = 0
        self.consumed_samples = 0

    def credits(self) -> int:
        return (self.max_lag + 2) * self.learner_batch_samples - (self.published_samples - self.consumed_samples)

    async def run(self, stop: asyncio.Event) -> None:
        async with ServiceClients(self.transport, self.topics.dead_letter, "producer") as io:
            pub: Publisher[Task] = io.publisher(self.topics.tasks)
            progress = await io.subscribe([self.topics.progress], f"producer-progress-{uuid.uuid4().hex[:8]}", LearnerProgress)
            while not stop.is_set():
                for d in await progress.poll(timeout_s=0.1, max_records=1000):
                    self.consumed_samples = max(self.consumed_samples, d.message.samples_consumed)
                while self.credits() > 0 and not stop.is_set():
                    task = next(self.tasks, None)
                    if task is None:
                        return
                    await pub.publish_and_wait(task, key=task.task_id)
                    self.published_samples += task.group_size
                    self.published_tasks += 1
