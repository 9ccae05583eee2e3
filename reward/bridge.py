"""Reward bridge: rollouts topic -> scorer (sandbox or Celery) -> scored topic.

Consumes rollouts in batches, has them scored (``reward/scorers.py``: in
this process, or one Celery task per rollout), publishes a ``ScoredRollout``
per rollout, waits for the broker's acknowledgements, and only then commits
the rollouts' offsets: a crash replays a batch, never skips one. A rollout
delivered twice to one bridge process is published once; across a bridge
crash it can be published twice, and the learner and the storage sink are
idempotent on ``rollout_id``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import structlog

from conveyor.contracts import Rollout, ScoredRollout, tool_episode_script
from conveyor.messaging import DRAINED_AFTER_EMPTY_POLLS, Publisher, ServiceClients
from conveyor.topics import Topics
from conveyor.transport.base import Transport

log = structlog.get_logger(__name__)
SEEN_WINDOW = 20_000


class RewardBridge:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        scorer,
        decode_text,
        *,
        group_id: str = "reward-bridge",
        max_batch: int = 256,
    ) -> None:
        self.transport = transport
        self.topics = topics
        self.scorer = scorer  # reward.scorers.LocalScorer | CeleryScorer
        self.decode_text = decode_text  # token ids -> text (the model's tokenizer)
        self.group_id = group_id
        self.max_batch = max_batch
        self.scored = 0
        # Ids scored recently (a redelivered rollout is not scored twice): a bounded window, enough
        # for redeliveries after a crash or a rebalance; the learner's ledger is the exact dedupe.
        # 200k string ids grew the bridge by 44 % over a 30-minute load run (bench/load.py).
        self._seen: OrderedDict[str, None] = OrderedDict()

    async def run(self, stop: asyncio.Event) -> None:
        """Score until ``stop`` is set and nothing more is waiting."""
        async with ServiceClients(self.transport, self.topics.dead_letter, "reward-bridge", heartbeats=self.topics) as io:
            publisher: Publisher[ScoredRollout] = io.publisher(self.topics.scored)
            sub = await io.subscribe([self.topics.rollouts], self.group_id, Rollout)
            quiet = 0  # consecutive empty polls
            while True:
                stopping = stop.is_set()
                deliveries = await sub.poll(timeout_s=0.2, max_records=self.max_batch)
                if not deliveries:
                    quiet += 1
                    if stopping and quiet >= DRAINED_AFTER_EMPTY_POLLS:
                        return  # drained: everything published upstream is scored
                    continue
                quiet = 0
                fresh = {d.message.rollout_id: d.message for d in deliveries if d.message.rollout_id not in self._seen}
                scored = await self._score(list(fresh.values()))  # a rollout delivered twice is scored once
                futures = [await publisher.publish(s, s.rollout.task_id) for s in scored]
                await asyncio.gather(*futures)
                for s in scored:
                    self._remember(s.rollout_id)
                await sub.commit(deliveries)
                self.scored += len(scored)

    def _remember(self, rollout_id: str) -> None:
        self._seen[rollout_id] = None
        if len(self._seen) > SEEN_WINDOW:
            self._seen.popitem(last=False)

    async def _score(self, rollouts: list[Rollout]) -> list[ScoredRollout]:
        texts = [self.decode_text(r.completion_token_ids.tolist()) for r in rollouts]
        # A multi-turn episode is judged by its last attempt.
        attempts = [t if (a := _judged_text(r)) is None else a for r, t in zip(rollouts, texts)]
        verdicts = await self.scorer.score([(r.task, a, r.rollout_id) for r, a in zip(rollouts, attempts)])
        return [
            ScoredRollout(rollout=r, reward=v.reward, verdict=v.verdict, feedback=v.feedback, details=v.details,  # type: ignore[arg-type]
                          completion_text=t)
            for r, v, t in zip(rollouts, verdicts, texts)
        ]


def _judged_text(rollout: Rollout) -> str | None:
    """What an episode is judged by: a tool episode's net script (the kept calls, replayed from
    the task's base), or a self-correction episode's last attempt; None for a single turn."""
    script = tool_episode_script(rollout.turns)
    if script is not None:
        return script
    for turn in reversed(rollout.turns):
        if turn.role == "assistant":
            return turn.text
    return None
