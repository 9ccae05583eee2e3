"""Reward bridge: rollouts topic -> sandbox -> scored topic.

Consumes rollouts in batches, executes each batch's programs in one sandbox
launch (identical programs once), publishes a ``ScoredRollout`` per rollout,
waits for the broker's acknowledgements, and only then commits the rollouts'
offsets: a crash replays a batch, never skips one. A rollout seen twice
(redelivery) is scored again but published once per bridge process; the
learner and the storage sink are idempotent on ``rollout_id`` as well.

In embedded mode the sandbox runs in a worker thread of this process; the
Celery executors of issue #4 replace that with queued tasks.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import structlog

from conveyor.contracts import Rollout, ScoredRollout
from conveyor.messaging import Publisher, ServiceClients
from conveyor.topics import Topics
from conveyor.transport.base import Transport
from reward.sandbox import Sandbox
from reward.verifiers import judge, program_of

log = structlog.get_logger(__name__)


class RewardBridge:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        sandbox: Sandbox,
        decode_text,
        *,
        group_id: str = "reward-bridge",
        max_batch: int = 256,
    ) -> None:
        self.transport = transport
        self.topics = topics
        self.sandbox = sandbox
        self.decode_text = decode_text  # token ids -> text (the model's tokenizer)
        self.group_id = group_id
        self.max_batch = max_batch
        self.scored = 0
        self.executions = 0
        self.busy_s = 0.0
        self._seen: OrderedDict[str, None] = OrderedDict()

    async def run(self, stop: asyncio.Event) -> None:
        """Score until ``stop`` is set and nothing more is waiting."""
        async with ServiceClients(self.transport, self.topics.dead_letter, "reward-bridge") as io:
            publisher: Publisher[ScoredRollout] = io.publisher(self.topics.scored)
            sub = await io.subscribe([self.topics.rollouts], self.group_id, Rollout)
            while True:
                stopping = stop.is_set()
                deliveries = await sub.poll(timeout_s=0.2, max_records=self.max_batch)
                if not deliveries:
                    if stopping:
                        return  # drained: everything published upstream is scored
                    continue
                fresh = [d for d in deliveries if d.message.rollout_id not in self._seen]
                scored = await asyncio.to_thread(self._score, [d.message for d in fresh])
                futures = [await publisher.publish(s, s.rollout.task_id) for s in scored]
                await asyncio.gather(*futures)
                for s in scored:
                    self._remember(s.rollout_id)
                await sub.commit(deliveries)
                self.scored += len(scored)

    def _remember(self, rollout_id: str) -> None:
        self._seen[rollout_id] = None
        if len(self._seen) > 200_000:
            self._seen.popitem(last=False)

    def _score(self, rollouts: list[Rollout]) -> list[ScoredRollout]:
        start = time.monotonic()
        texts = [self.decode_text(r.completion_token_ids.tolist()) for r in rollouts]
        programs = [program_of(r.task, t) if r.task else None for r, t in zip(rollouts, texts)]
        runnable = [p for p in programs if p is not None]
        results = iter(self.sandbox.run_batch(runnable))
        self.executions += len(set(runnable))
        out = []
        for r, text, program in zip(rollouts, texts, programs):
            if r.task is None:  # nothing says how to verify it
                out.append(ScoredRollout(rollout=r, reward=0.0, verdict="error"))
                continue
            v = judge(r.task, text, next(results) if program is not None else None)
            out.append(ScoredRollout(rollout=r, reward=v.reward, verdict=v.verdict, feedback=v.feedback))  # type: ignore[arg-type]
        self.busy_s += time.monotonic() - start
        return out
