"""How the bridge gets rewards: in this process, or from Celery workers.

Both take ``(task, completion, rollout_id)`` items and return one
:class:`~tasks.verifiers.Verdict` per item, in order.

- :class:`LocalScorer` (embedded mode): one sandbox launch per batch in a
  worker thread; identical programs of a batch run once.
- :class:`CeleryScorer`: one Celery task per sandbox rollout (task id =
  rollout id), batches of rollouts scored in the worker's process, results
  streamed back as each task completes; a task whose worker died is
  submitted again. A task that failed for good (infrastructure retries
  exhausted, or no result within ``result_timeout_s``) becomes an ``infra``
  verdict, which the learner drops: it says nothing about the model.

Both also ``submit(items)``: one future per item, which the reward bridge
publishes as it resolves (``reward/bridge.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import structlog
from celery import states
from celery.result import AsyncResult

from conveyor.contracts import Feedback, Task
from tasks import registry
from tasks.verifiers import Verdict, score_batch

log = structlog.get_logger(__name__)
Item = tuple[Task | None, str, str]  # (task, completion text, rollout id)


class LocalScorer:
    """The sandbox in this process: one launch per batch, one batch at a time (the sandbox's
    slots already run a batch's programs in parallel)."""

    def __init__(self, sandbox, *, fn_timeout_s: float | None = 60.0) -> None:
        self.sandbox = sandbox
        self.fn_timeout_s = fn_timeout_s  # a user's verifier function past it scores its samples error
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}

    async def score(self, items: Sequence[Item]) -> list[Verdict]:
        lock = self._locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        async with lock:
            return await asyncio.to_thread(
                lambda: score_batch(self.sandbox, [(t, c) for t, c, _ in items], fn_timeout_s=self.fn_timeout_s)
            )

    def submit(self, items: Sequence[Item]) -> list[asyncio.Future]:
        batch = asyncio.ensure_future(self.score(items))
        return [asyncio.ensure_future(_nth(batch, i)) for i in range(len(items))]

    def close(self) -> None:
        pass


async def _nth(batch: asyncio.Future, i: int) -> Verdict:
    return (await asyncio.shield(batch))[i]


class CeleryScorer:
    """Celery tasks scoring rollouts, results streamed back as they complete.

    A rollout whose kind runs in the sandbox is one task (task id = rollout id); rollouts whose
    kinds run in the worker's process travel up to ``batch_size`` per task
    (``reward/celery_app.py`` says why), the task's id derived from its rollout ids.

    Results are read by one collector thread that polls the result backend (one ``MGET`` per
    round on Redis; each pending result's state elsewhere), so a slow or lost task holds back
    nothing but its own rollouts. Nothing subscribes to Redis's result channels: a subscription
    that is never drained fills the connection's buffer (Celery keeps messages of results resolved
    already, +21 MiB over a 30-minute load run, ``bench/load.py``).

    A task that a reward worker started and that has no result ``hard_time_limit_s + 5`` s later
    ran on a worker that died (a live worker ends it at its hard limit): it is submitted again
    under the same id, so a result stored twice is stored under one key and read once, instead
    of waiting for the broker's visibility timeout. A task with no result after
    ``result_timeout_s`` (or ``max_resubmits`` re-submissions) becomes an ``infra`` verdict.
    """

    carries_trace = True  # submit(trace=) puts each rollout's trace context in its Celery task

    def __init__(self, app, *, result_timeout_s: float = 600.0, stuck_after_s: float | None = None,
                 max_resubmits: int = 3, poll_s: float = 0.05, queues: dict[str, str] | None = None,
                 batch_size: int = 64) -> None:  # fmt: skip
        self.app = app
        self.queues = dict(queues or {})  # verifier kind -> Celery queue (default: the app's reward queue)
        self.task = app.conveyor_score
        self.batch_task = app.conveyor_score_many
        self.batch_size = batch_size
        self.result_timeout_s = result_timeout_s
        hard = app.conf.task_time_limit or 90.0
        self.stuck_after_s = stuck_after_s if stuck_after_s is not None else hard + 5.0
        self.max_resubmits = max_resubmits
        self.poll_s = poll_s
        self.resubmitted = 0
        self.tasks_sent = 0
        self._pending: dict[str, _Pending] = {}  # rollout id -> who waits for it
        self._sent: dict[str, _Sent] = {}  # Celery task id -> the rollouts it scores
        self._unsent: list[_Sent] = []  # made, not accepted by the broker yet
        self._outbox: list[str] = []  # submitted, not sent yet: the collector thread sends them
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._kv = hasattr(app.backend, "mget") and hasattr(app.backend, "get_key_for_task")
        self.backend = None  # the collector thread's: Celery keeps one backend per thread

    def submit(self, items: Sequence[Item], trace: Mapping[str, dict[str, str]] | None = None) -> list[asyncio.Future]:
        """One future per item, resolved with its Verdict as its task completes. ``trace``: rollout
        id -> the trace context its Celery task carries (``conveyor/tracing.py``)."""
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
                kind = task.verifier.kind
                batched = self.batch_size > 1 and registry.where(kind) == "worker"
                args = [msgspec.to_builtins(task), completion, rollout_id]
                self._pending[rollout_id] = _Pending([(fut, loop)], args, kind, batched, (trace or {}).get(rollout_id))
                self._outbox.append(rollout_id)
        self._ensure_collector()
        self._wake.set()
        return out

    async def score(self, items: Sequence[Item]) -> list[Verdict]:
        return list(await asyncio.gather(*self.submit(items)))

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _ensure_collector(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._collect_forever, name="celery-results", daemon=True)
            self._thread.start()

    def _tasks_of(self, rids: list[str]) -> list[_Sent]:
        """The Celery tasks for newly submitted rollouts: one per sandbox rollout, batches of the
        rest by queue, in submission order."""
        now = time.monotonic()
        out: list[_Sent] = []
        groups: dict[str | None, list[str]] = {}
        with self._lock:
            for rid in rids:
                p = self._pending.get(rid)
                if p is None:
                    continue
                queue = self.queues.get(p.kind)
                if p.batched:
                    groups.setdefault(queue, []).append(rid)
                else:
                    out.append(_Sent(rid, [rid], p.args, queue, False, now, now, headers=p.headers))
            for queue, members in groups.items():
                for i in range(0, len(members), self.batch_size):
                    chunk = members[i : i + self.batch_size]
                    task_id = "b-" + hashlib.sha1("\0".join(chunk).encode()).hexdigest()  # noqa: S324 - an id, not a secret
                    args = [[*self._pending[r].args, self._pending[r].headers] for r in chunk]
                    out.append(_Sent(task_id, chunk, args, queue, True, now, now))
        return out

    def _send(self, sent: _Sent) -> None:
        if sent.batch:
            self.batch_task.apply_async(args=[sent.args], task_id=sent.task_id, queue=sent.queue)
        else:
            self.task.apply_async(args=sent.args, task_id=sent.task_id, queue=sent.queue, headers=sent.headers)
        self.tasks_sent += 1

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
            try:
                self._round()
            except Exception:  # noqa: BLE001 - this thread is every pending rollout's only way out: it goes on
                log.exception("reward_collector_round_failed")
                time.sleep(self.poll_s)

    def _round(self) -> None:
        """Send what was submitted, read what is ready, enforce the deadlines."""
        with self._lock:
            outbox, self._outbox = self._outbox, []
        self._unsent += self._tasks_of(outbox)
        unsent = self._unsent
        now = time.monotonic()
        while unsent:
            sent = unsent[0]
            if now - sent.submitted_at > self.result_timeout_s:  # the broker stayed down
                self._fail(unsent.pop(0), f"not sent within {self.result_timeout_s:g} s")
                continue
            try:
                self._send(sent)
            except Exception as exc:  # noqa: BLE001 - the broker is down: sent again next round
                log.warning("reward_task_not_sent", task_id=sent.task_id, error=str(exc)[:300])
                time.sleep(self.poll_s)
                break
            self._sent[sent.task_id] = unsent.pop(0)
        if not self._sent:
            return
        ids = list(self._sent)
        try:
            metas = self._metas(ids)
        except Exception as exc:  # noqa: BLE001 - the backend is down: keep waiting, the deadlines still hold
            log.warning("reward_results_unreadable", error=str(exc)[:300])
            metas = {}
        now = time.monotonic()
        for task_id in ids:
            s = self._sent[task_id]
            meta = metas.get(task_id)
            status = meta.get("status") if meta else None
            if status in states.READY_STATES:
                self._finish(s, _verdicts(s, meta))  # type: ignore[arg-type]
                continue
            if status != s.status:  # started, retried, started again: its clock restarts
                s.status, s.since = status, now
            if now - s.submitted_at > self.result_timeout_s:
                self._fail(s, f"no result within {self.result_timeout_s:g} s")
            elif status == states.STARTED and now - s.since > self.stuck_after_s:
                if s.resubmits >= self.max_resubmits:
                    self._fail(s, "the reward task's workers kept dying")
                else:
                    stuck_s = now - s.since
                    s.resubmits += 1
                    s.status, s.since = None, now
                    self.resubmitted += 1
                    log.warning("reward_task_resubmitted", task_id=task_id, stuck_s=round(stuck_s, 1), resubmits=s.resubmits)
                    self._send(s)

    def _metas(self, ids: list[str]) -> dict[str, dict]:
        backend = self.backend
        if self._kv:
            values = backend.mget([backend.get_key_for_task(tid) for tid in ids])
            return {tid: backend.decode_result(v) for tid, v in zip(ids, values) if v}
        out = {}
        for tid in ids:
            r = AsyncResult(tid, app=self.app)
            out[tid] = {"status": r.state, "result": r.result}
        return out

    def _fail(self, sent: _Sent, reason: str) -> None:
        self._finish(sent, dict.fromkeys(sent.rids, Verdict(0.0, "infra", Feedback(message=reason))))

    def _finish(self, sent: _Sent, verdicts: Mapping[str, Verdict]) -> None:
        self._sent.pop(sent.task_id, None)
        try:
            AsyncResult(sent.task_id, app=self.app).forget()
        except Exception as exc:  # noqa: BLE001 - the result expires by itself (result_expires)
            log.warning("reward_result_not_forgotten", task_id=sent.task_id, error=str(exc)[:200])
        for rid in sent.rids:
            with self._lock:
                p = self._pending.pop(rid, None)
            if p is None:
                continue
            for fut, loop in p.futures:
                loop.call_soon_threadsafe(_resolve, fut, verdicts[rid])

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.app.close()


@dataclass
class _Pending:
    """A submitted rollout."""

    futures: list[tuple[asyncio.Future, asyncio.AbstractEventLoop]]  # every caller waiting for this rollout
    args: list  # [task, completion, rollout id]
    kind: str
    batched: bool
    headers: dict[str, str] | None = None  # the trace context


@dataclass
class _Sent:
    """A Celery task sent."""

    task_id: str
    rids: list[str]
    args: list
    queue: str | None
    batch: bool
    submitted_at: float
    since: float  # when the task's state last changed (as this scorer saw it)
    status: str | None = None
    resubmits: int = 0
    headers: dict[str, str] | None = None  # a single rollout's trace context, in the task's headers


def _resolve(fut: asyncio.Future, verdict: Verdict) -> None:
    if not fut.done():
        fut.set_result(verdict)


def _verdicts(sent: _Sent, meta: dict) -> dict[str, Verdict]:
    """Each rollout's verdict from its task's result; a result that cannot be read is ``infra``."""
    value = meta.get("result")
    if meta.get("status") == states.SUCCESS:
        results = value if sent.batch else {sent.task_id: value}
        try:
            return {rid: _verdict_of(results[rid]) for rid in sent.rids}
        except (TypeError, KeyError, msgspec.ValidationError) as exc:
            value = f"unreadable result ({type(exc).__name__}: {exc})"
    log.error("reward_task_failed", task_id=sent.task_id, status=meta.get("status"), error=repr(value)[:300])
    return dict.fromkeys(sent.rids, Verdict(0.0, "infra", Feedback(message=f"reward task failed: {value!r}"[:500])))


def _verdict_of(value: dict) -> Verdict:
    fb = value.get("feedback")
    return Verdict(value["reward"], value["verdict"], msgspec.convert(fb, Feedback) if fb else None, value.get("details") or {})
