"""How the bridge gets rewards: in this process, or from Celery workers.

Both take ``(task, completion, rollout_id)`` items and return one
:class:`~tasks.verifiers.Verdict` per item, in order.

- :class:`LocalScorer` (embedded mode): one sandbox launch per batch in a
  worker thread; identical programs of a batch run once.
- :class:`CeleryScorer`: one Celery task per rollout (task id = rollout id),
  results streamed back as each completes; a task whose worker died is
  submitted again. A task that failed for good (infrastructure retries
  exhausted, or no result within ``result_timeout_s``) becomes an ``infra``
  verdict, which the learner drops: it says nothing about the model.

Both also ``submit(items)``: one future per item, which the reward bridge
publishes as it resolves (``reward/bridge.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import structlog
from celery import states
from celery.result import AsyncResult

from conveyor.contracts import Feedback, Task
from tasks.verifiers import Verdict, score_batch

log = structlog.get_logger(__name__)
Item = tuple[Task | None, str, str]  # (task, completion text, rollout id)


class LocalScorer:
    """The sandbox in this process: one launch per batch, one batch at a time (the sandbox's
    slots already run a batch's programs in parallel)."""

    def __init__(self, sandbox) -> None:
        self.sandbox = sandbox
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}

    async def score(self, items: Sequence[Item]) -> list[Verdict]:
        lock = self._locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        async with lock:
            return await asyncio.to_thread(score_batch, self.sandbox, [(t, c) for t, c, _ in items])

    def submit(self, items: Sequence[Item]) -> list[asyncio.Future]:
        batch = asyncio.ensure_future(self.score(items))
        return [asyncio.ensure_future(_nth(batch, i)) for i in range(len(items))]

    def close(self) -> None:
        pass


async def _nth(batch: asyncio.Future, i: int) -> Verdict:
    return (await asyncio.shield(batch))[i]


class CeleryScorer:
    """One Celery task per item (task id = rollout id), results streamed back as they complete.

    Results are read by one collector thread that polls the result backend (one ``MGET`` per
    round on Redis; each pending result's state elsewhere), so a slow or lost task holds back
    nothing but itself. Nothing subscribes to Redis's result channels: a subscription that is
    never drained fills the connection's buffer (Celery keeps messages of results resolved
    already, +21 MiB over a 30-minute load run, ``bench/load.py``).

    A task that a reward worker started and that has no result ``hard_time_limit_s + 5`` s later
    ran on a worker that died (a live worker ends it at its hard limit): it is submitted again
    under the same id, so a result stored twice is stored under one key and read once, instead
    of waiting for the broker's visibility timeout. A task with no result after
    ``result_timeout_s`` (or ``max_resubmits`` re-submissions) becomes an ``infra`` verdict.
    """

    carries_trace = True  # submit(trace=) puts each rollout's trace context in its Celery task's headers

    def __init__(self, app, *, result_timeout_s: float = 600.0, stuck_after_s: float | None = None,
                 max_resubmits: int = 3, poll_s: float = 0.05, queues: dict[str, str] | None = None) -> None:  # fmt: skip
        self.app = app
        self.queues = dict(queues or {})  # verifier kind -> Celery queue (default: the app's reward queue)
        self.task = app.conveyor_score
        self.result_timeout_s = result_timeout_s
        hard = app.conf.task_time_limit or 90.0
        self.stuck_after_s = stuck_after_s if stuck_after_s is not None else hard + 5.0
        self.max_resubmits = max_resubmits
        self.poll_s = poll_s
        self.resubmitted = 0
        self._pending: dict[str, _Pending] = {}
        self._outbox: list[str] = []  # submitted, not sent yet: the collector thread sends them
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._kv = hasattr(app.backend, "mget") and hasattr(app.backend, "get_key_for_task")
        self.backend = None  # the collector thread's: Celery keeps one backend per thread

    def submit(self, items: Sequence[Item], trace: Mapping[str, dict[str, str]] | None = None) -> list[asyncio.Future]:
        """One future per item, resolved with its Verdict as its task completes. ``trace``: rollout
        id -> the trace context its Celery task carries in its headers (``conveyor/tracing.py``)."""
        loop = asyncio.get_running_loop()
        out: list[asyncio.Future] = []
        for task, completion, rollout_id in items:
            fut = loop.create_future()
            out.append(fut)
            if task is None:
                fut.set_result(Verdict(0.0, "error", Feedback(message="rollout carries no task: nothing says how to verify it")))
                continue
            with self._lock:
                waiting = self._pending.get(rollout_id)
                if waiting is not None:  # already being scored: this caller gets the same verdict
                    waiting.futures.append((fut, loop))
                    continue
                now = time.monotonic()
                args = [msgspec.to_builtins(task), completion, rollout_id]
                self._pending[rollout_id] = _Pending([(fut, loop)], args, now, now, headers=(trace or {}).get(rollout_id))
                self._outbox.append(rollout_id)
        self._ensure_collector()
        self._wake.set()
        return out

    async def score(self, items: Sequence[Item]) -> list[Verdict]:
        return list(await asyncio.gather(*self.submit(items)))

    def _queue(self, args: list) -> str | None:
        """The queue a task goes to: its verifier kind's own (``reward.queues``), else the default."""
        return self.queues.get(args[0].get("verifier", {}).get("kind", "")) if self.queues else None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _ensure_collector(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._collect_forever, name="celery-results", daemon=True)
            self._thread.start()

    def _collect_forever(self) -> None:
        """Send what was submitted and read the results, all from this one thread: kombu's
        connections are not shared between threads, and the rpc:// backend replies to the
        thread that sent the task."""
        # Celery's Redis backend is per thread: this thread's is the one that sends and reads.
        # Results are read by MGET, never from Redis's pub/sub channel, so it subscribes to nothing
        # (a subscription per task grew the bridge by 2.5 MiB a minute: the channels and their keys).
        self.backend = self.app.backend
        if self._kv:
            self.backend.on_task_call = lambda producer, task_id: None
        while not self._closed:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            with self._lock:
                outbox, self._outbox = self._outbox, []
                sends = [(rid, self._pending[rid].args, self._pending[rid].headers) for rid in outbox if rid in self._pending]
            for rid, args, headers in sends:
                try:
                    self.task.apply_async(args=args, task_id=rid, queue=self._queue(args), headers=headers)
                except Exception as exc:  # noqa: BLE001 - the broker is down: sent again below, or infra at the deadline
                    log.warning("reward_task_not_sent", task_id=rid, error=str(exc)[:300])
                    with self._lock:
                        self._outbox.append(rid)
                    time.sleep(self.poll_s)
            with self._lock:
                ids = list(self._pending)
            if not ids:
                continue
            try:
                metas = self._metas(ids)
            except Exception as exc:  # noqa: BLE001 - the backend is down: keep waiting, the deadlines still hold
                log.warning("reward_results_unreadable", error=str(exc)[:300])
                metas = {}
            now = time.monotonic()
            for rid in ids:
                with self._lock:
                    p = self._pending.get(rid)
                if p is None:
                    continue
                meta = metas.get(rid)
                status = meta.get("status") if meta else None
                if status in states.READY_STATES:
                    self._finish(rid, p, _verdict(rid, meta))
                    continue
                if status != p.status:  # started, retried, started again: its clock restarts
                    p.status, p.since = status, now
                if now - p.submitted_at > self.result_timeout_s:
                    self._finish(rid, p, Verdict(0.0, "infra", Feedback(message=f"no result within {self.result_timeout_s:g} s")))
                elif status == states.STARTED and now - p.since > self.stuck_after_s:
                    if p.resubmits >= self.max_resubmits:
                        self._finish(rid, p, Verdict(0.0, "infra", Feedback(message="the reward task's workers kept dying")))
                    else:
                        stuck_s = now - p.since
                        p.resubmits += 1
                        p.status, p.since = None, now
                        self.resubmitted += 1
                        log.warning("reward_task_resubmitted", task_id=rid, stuck_s=round(stuck_s, 1), resubmits=p.resubmits)
                        self.task.apply_async(args=p.args, task_id=rid, queue=self._queue(p.args), headers=p.headers)

    def _metas(self, ids: list[str]) -> dict[str, dict]:
        backend = self.backend
        if self._kv:
            values = backend.mget([backend.get_key_for_task(rid) for rid in ids])
            return {rid: backend.decode_result(v) for rid, v in zip(ids, values) if v}
        out = {}
        for rid in ids:
            r = AsyncResult(rid, app=self.app)
            out[rid] = {"status": r.state, "result": r.result}
        return out

    def _finish(self, rid: str, p: _Pending, verdict: Verdict) -> None:
        with self._lock:
            self._pending.pop(rid, None)
        try:
            AsyncResult(rid, app=self.app).forget()
        except Exception as exc:  # noqa: BLE001 - the result expires by itself (result_expires)
            log.warning("reward_result_not_forgotten", task_id=rid, error=str(exc)[:200])
        for fut, loop in p.futures:
            loop.call_soon_threadsafe(_resolve, fut, verdict)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.app.close()


@dataclass
class _Pending:
    futures: list[tuple[asyncio.Future, asyncio.AbstractEventLoop]]  # every caller waiting for this rollout
    args: list
    submitted_at: float
    since: float  # when the task's state last changed (as this scorer saw it)
    status: str | None = None
    resubmits: int = 0
    headers: dict[str, str] | None = None  # the trace context, in the Celery task's headers


def _resolve(fut: asyncio.Future, verdict: Verdict) -> None:
    if not fut.done():
        fut.set_result(verdict)


def _verdict(rid: str, meta: dict) -> Verdict:
    value = meta.get("result")
    if meta.get("status") == states.SUCCESS and isinstance(value, dict):
        fb = value.get("feedback")
        return Verdict(
            value["reward"], value["verdict"], msgspec.convert(fb, Feedback) if fb else None, value.get("details") or {}
        )
    log.error("reward_task_failed", task_id=rid, status=meta.get("status"), error=repr(value)[:300])
    return Verdict(0.0, "infra", Feedback(message=f"reward task failed: {value!r}"[:500]))
