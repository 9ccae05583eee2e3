"""Reward bridge: rollouts topic -> scorer (sandbox or Celery) -> scored topic.

Rollouts are scored as a stream: up to ``max_inflight`` at once, each
published to the scored topic as soon as its verdict comes back, whatever
the others are doing, so one slow or lost reward task holds back nothing but
itself (its partition's commit waits for it; a task whose worker died is
re-submitted by the scorer, idempotent on the rollout id). Offsets are
committed per partition up to the first rollout not yet published and
acknowledged: a crash replays, never skips. A rollout delivered twice to one
bridge process is published once; across a bridge crash it can be published
twice, and the learner and the storage sink are idempotent on ``rollout_id``.

Stopping: nothing new is taken once ``stop`` is set; what is in flight is
scored and published, and the topic is drained of what was generated before
the stop (the rollout workers stop first). A drain that has not finished
within ``drain_timeout_s`` raises :class:`DrainTimeout`, so the process exits
non-zero and the run's supervisor reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import typing
from collections import OrderedDict, deque
from typing import Any

import structlog

from conveyor.config import BridgeConfig
from conveyor.contracts import Feedback, Rollout, ScoredRollout, tool_episode_script
from conveyor.limits import MAX_ABS_REWARD
from conveyor.messaging import DRAINED_AFTER_EMPTY_POLLS, ClaimCheck, Delivery, Publisher, ServiceClients, Subscriber
from conveyor.metrics import RewardMetrics, process_reward_metrics
from conveyor.topics import Topics
from conveyor.tracing import headers_of, start_child, text_headers
from conveyor.transport.base import CommitFailed, TopicPartition, Transport

log = structlog.get_logger(__name__)
SEEN_WINDOW = 20_000


class DrainTimeout(RuntimeError):
    """The bridge was told to stop and could not score what was generated in time."""


class _Entry:
    __slots__ = ("delivery", "done")

    def __init__(self, delivery: Delivery[Rollout]) -> None:
        self.delivery = delivery
        self.done = False  # published and acknowledged (or a duplicate of one that was)


class RewardBridge:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        scorer,
        decode_text,
        config: BridgeConfig | None = None,
        *,
        group_id: str | None = None,
        claim_check: ClaimCheck | None = None,
        metrics: RewardMetrics | None = None,
    ) -> None:
        self.claim_check = claim_check  # messages over its threshold travel through the object store
        cfg = config or BridgeConfig()
        self.transport = transport
        self.topics = topics
        self.scorer = scorer  # reward.scorers.LocalScorer | CeleryScorer
        self.decode_text = decode_text  # token ids -> text (the model's tokenizer)
        self.group_id = group_id or (topics.group("reward-bridge") if topics is not None else None)
        self.max_batch = cfg.max_batch  # rollouts taken per poll
        self.max_inflight = cfg.max_inflight  # rollouts polled and not yet published
        self.drain_timeout_s = cfg.drain_timeout_s
        self.scored = 0
        # Ids scored recently (a redelivered rollout is not scored twice): a bounded window, enough
        # for redeliveries after a crash or a rebalance; the learner's ledger is the exact dedupe.
        # 200k string ids grew the bridge by 44 % over a 30-minute load run (bench/load.py).
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._partitions: dict[TopicPartition, deque[_Entry]] = {}
        # future -> (entry, rollout, text, submitted at (monotonic), its score span)
        self._scoring: dict[asyncio.Future, tuple[_Entry, Rollout, str, float, Any]] = {}
        self._copies: dict[str, list[_Entry]] = {}  # rollout id being scored -> its other deliveries
        # Futures that resolved, in order, each put here by its own done-callback: waiting on all
        # of ``_scoring`` at once (asyncio.wait) costs a callback per future per round, which at
        # thousands in flight was the bridge's largest cost.
        self._resolved: list[asyncio.Future] = []
        self._wake = asyncio.Event()
        self._inflight = 0
        self.metrics = metrics if metrics is not None else process_reward_metrics()  # Prometheus, when served

    async def run(self, stop: asyncio.Event) -> None:
        """Score until ``stop`` is set and nothing more is waiting."""
        async with ServiceClients(
            self.transport, self.topics.dead_letter, "reward-bridge", heartbeats=self.topics, claim_check=self.claim_check
        ) as io:
            publisher: Publisher[ScoredRollout] = io.publisher(self.topics.scored)
            sub = await io.subscribe([self.topics.rollouts], self.group_id, Rollout)
            quiet = 0  # consecutive empty polls once stopping
            stop_at: float | None = None
            while True:
                if stop.is_set() and stop_at is None:
                    stop_at = time.monotonic()
                    log.info("reward_bridge.draining", in_flight=self._inflight)
                if stop_at is not None and time.monotonic() - stop_at > self.drain_timeout_s:
                    raise DrainTimeout(f"{self._inflight} rollouts still unscored {self.drain_timeout_s:g} s after the stop")
                room = min(self.max_batch, self.max_inflight - self._inflight)
                got = []
                if room > 0:
                    got = await sub.poll(timeout_s=0 if self._scoring else 0.2, max_records=room)
                    self._take(got)
                if self._scoring:
                    if not self._resolved:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), 0.05)
                    self._wake.clear()
                    done, self._resolved = self._resolved, []
                    await self._publish(done, publisher)
                await self._commit(sub)
                if self.metrics:
                    self.metrics.in_flight.set(self._inflight)
                if stop_at is not None:
                    quiet = 0 if got or self._inflight else quiet + 1
                    if quiet >= DRAINED_AFTER_EMPTY_POLLS:
                        return  # drained: everything published upstream is scored

    def _take(self, deliveries: list[Delivery[Rollout]]) -> None:
        """Track each delivery in its partition's order and submit the ones not scored yet."""
        fresh: dict[str, tuple[_Entry, Rollout]] = {}
        for d in deliveries:
            entry = _Entry(d)
            self._partitions.setdefault(d.record.tp, deque()).append(entry)
            self._inflight += 1
            rid = d.message.rollout_id
            if rid in self._seen:  # delivered again after it was published: published once
                entry.done = True
                self._inflight -= 1
            elif rid in self._copies or rid in fresh:  # delivered again while being scored: done with it
                self._copies.setdefault(rid, []).append(entry)
            else:
                fresh[rid] = (entry, d.message)
                self._copies[rid] = []
        if not fresh:
            return
        rollouts = [r for _, r in fresh.values()]
        spans = {rid: start_child("score", e.delivery.record.headers, **{"conveyor.rollout_id": rid})
                 for rid, (e, _) in fresh.items()}  # fmt: skip
        texts, futures = self._submit(rollouts, {rid: h for rid, span in spans.items() if (h := text_headers(span))})
        now = time.monotonic()
        for (entry, r), text, fut in zip(fresh.values(), texts, futures):
            self._scoring[fut] = (entry, r, text, now, spans[r.rollout_id])
            fut.add_done_callback(self._on_resolved)

    def _on_resolved(self, fut: asyncio.Future) -> None:
        self._resolved.append(fut)
        self._wake.set()

    def _submit(
        self, rollouts: list[Rollout], trace: dict[str, dict[str, str]] | None = None
    ) -> tuple[list[str], list[asyncio.Future]]:
        """Each rollout's completion text, and a future of its verdict (an ``infra`` verdict, never
        an exception, for a rollout that cannot be read or scored: one rollout stops nothing)."""
        texts = [self._text(r) for r in rollouts]
        # A multi-turn episode is judged by its last attempt.
        attempts = [t if (a := _judged_text(r)) is None else a for r, t in zip(rollouts, texts)]
        # A rollout the worker refused has nothing to score: it is ``infra`` (not trained, counted).
        scored = [i for i, r in enumerate(rollouts) if r.finish_reason != "error"]
        futures = [None if r.finish_reason != "error" else _refused(r) for r in rollouts]
        if scored:
            try:
                items = [(rollouts[i].task, attempts[i], rollouts[i].rollout_id) for i in scored]
                # A scorer that runs elsewhere carries the trace on (Celery: in its task headers).
                carries = trace and getattr(self.scorer, "carries_trace", False)
                got = self.scorer.submit(items, trace=trace) if carries else self.scorer.submit(items)
            except Exception as exc:  # noqa: BLE001 - the scorer refused the batch: each rollout says why
                log.error("reward_bridge.submit_failed", rollouts=len(scored), error=repr(exc)[:300])
                got = [_failed(exc) for _ in scored]
            for i, fut in zip(scored, got):
                futures[i] = fut
        return texts, futures

    def _text(self, rollout: Rollout) -> str:
        try:
            return self.decode_text(rollout.completion_token_ids.tolist())
        except Exception as exc:  # noqa: BLE001 - e.g. token ids outside the tokenizer's vocabulary
            log.warning("reward_bridge.undecodable_completion", rollout_id=rollout.rollout_id, error=repr(exc)[:200])
            return ""

    async def score(self, rollouts: list[Rollout]) -> list[ScoredRollout]:
        """What the bridge publishes for ``rollouts``, without a topic (for tests and replays)."""
        texts, futures = self._submit(rollouts)
        verdicts = await asyncio.gather(*futures, return_exceptions=True)
        return [_scored(r, _infra(v) if isinstance(v, BaseException) else v, t) for r, v, t in zip(rollouts, verdicts, texts)]

    async def _publish(self, done: list[asyncio.Future], publisher: Publisher[ScoredRollout]) -> None:
        """Publish the verdicts that came back; an entry is done once the broker acknowledged it."""
        acks, entries = [], []
        for fut in done:
            entry, r, text, submitted, span = self._scoring.pop(fut)
            verdict = fut.result() if fut.exception() is None else _infra(fut.exception())
            scored = _scored(r, verdict, text)
            span.set_attribute("conveyor.verdict", scored.verdict)
            span.end()
            acks.append(await publisher.publish(scored, r.task_id, headers_of(span)))
            entries.append(entry)
            if self.metrics:
                kind = r.task.verifier.kind if r.task is not None else "none"  # a rollout may carry no task
                self.metrics.observe(kind, scored.verdict, time.monotonic() - submitted, scored.details)
        await asyncio.gather(*acks)
        for entry in entries:
            rid = entry.delivery.message.rollout_id
            copies = self._copies.pop(rid, [])
            for e in (entry, *copies):
                e.done = True
            self._inflight -= 1 + len(copies)
            self._remember(rid)
        self.scored += len(entries)

    async def _commit(self, sub: Subscriber[Rollout]) -> None:
        """Commit, per partition, up to the first rollout not yet published."""
        ready: list[Delivery[Rollout]] = []
        assigned = sub.assignment()
        for tp, entries in list(self._partitions.items()):
            last = None
            while entries and entries[0].done:
                last = entries.popleft()
            if tp not in assigned:  # rebalanced away: its new owner re-reads and commits it
                if not entries:
                    del self._partitions[tp]
            elif last is not None:
                ready.append(last.delivery)
        if not ready:
            return
        try:
            await sub.commit(ready)
        except CommitFailed as exc:  # rebalanced away: the new owner re-reads them (published once more at worst)
            log.warning("reward_bridge.commit_after_rebalance", error=str(exc)[:200])

    def _remember(self, rollout_id: str) -> None:
        self._seen[rollout_id] = None
        if len(self._seen) > SEEN_WINDOW:
            self._seen.popitem(last=False)


VERDICTS = frozenset(typing.get_args(typing.get_type_hints(ScoredRollout)["verdict"]))


def _scored(rollout: Rollout, v, text: str) -> ScoredRollout:
    """The scored record of a verdict. A verdict no consumer could read (a user's function that
    returned NaN, an infinite or huge reward, an unknown verdict name or non-numeric details)
    becomes an ``error`` verdict saying why, instead of a record the learner would train NaN on."""
    feedback = v.feedback
    try:
        reward = float(v.reward)
        verdict = v.verdict
        details = {str(k): float(x) for k, x in (v.details or {}).items() if math.isfinite(float(x))}
        if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
            raise ValueError(f"reward {reward!r} is not a finite number within ±{MAX_ABS_REWARD:g}")
        if verdict not in VERDICTS:
            raise ValueError(f"verdict {verdict!r} is not one of {sorted(VERDICTS)}")
    except (TypeError, ValueError) as exc:
        reward, verdict, details = 0.0, "error", {}
        feedback = Feedback(message=f"the verifier's result was refused: {exc}"[:500])
        log.warning("reward_bridge.verdict_refused", rollout_id=rollout.rollout_id, error=str(exc)[:200])
    return ScoredRollout(
        rollout=rollout,
        reward=reward,
        verdict=verdict,
        feedback=feedback,
        details=details,
        completion_text=text,
    )


def _infra(exc: BaseException):
    from tasks.verifiers import Verdict

    log.error("reward_bridge.scoring_failed", error=repr(exc)[:300])
    return Verdict(0.0, "infra", Feedback(message=f"scoring failed: {type(exc).__name__}: {exc}"[:500]))


def _refused(rollout: Rollout) -> asyncio.Future:
    from tasks.verifiers import Verdict

    fut = asyncio.get_running_loop().create_future()
    fut.set_result(Verdict(0.0, "infra", Feedback(message=f"the rollout worker refused the task: {rollout.error}"[:500])))
    return fut


def _failed(exc: Exception) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


def _judged_text(rollout: Rollout) -> str | None:
    """What an episode is judged by: an environment episode's actions (the model's turns, as a
    JSON list the environment replays), a tool episode's net script (the kept calls, replayed from
    the task's base), or a self-correction episode's last attempt; None for a single turn."""
    if rollout.task is not None and rollout.task.verifier.kind == "environment" and rollout.turns:
        return json.dumps([t.text for t in rollout.turns if t.role == "assistant"])
    script = tool_episode_script(rollout.turns)
    if script is not None:
        return script
    for turn in reversed(rollout.turns):
        if turn.role == "assistant":
            return turn.text
    return None
