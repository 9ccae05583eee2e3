"""How the bridge gets rewards: in this process, or from Celery workers.

Both take ``(task, completion, rollout_id)`` items and return one
:class:`~reward.verifiers.Verdict` per item, in order.

- :class:`LocalScorer` (embedded mode): one sandbox launch per batch in a
  worker thread; identical programs of a batch run once.
- :class:`CeleryScorer`: one Celery task per rollout (task id = rollout id),
  results gathered from the result backend. A task that failed for good
  (infrastructure retries exhausted, or no result within
  ``result_timeout_s``) becomes an ``infra`` verdict, which the learner
  drops: it says nothing about the model.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

import msgspec
import structlog

from conveyor.contracts import Feedback, Task
from reward.verifiers import Verdict, score_batch

log = structlog.get_logger(__name__)
Item = tuple[Task | None, str, str]  # (task, completion text, rollout id)


class LocalScorer:
    def __init__(self, sandbox) -> None:
        self.sandbox = sandbox

    async def score(self, items: Sequence[Item]) -> list[Verdict]:
        return await asyncio.to_thread(score_batch, self.sandbox, [(t, c) for t, c, _ in items])

    def close(self) -> None:
        pass


class CeleryScorer:
    def __init__(self, app, *, result_timeout_s: float = 600.0) -> None:
        self.app = app
        self.task = app.conveyor_score
        self.result_timeout_s = result_timeout_s
        self._collected: deque[str] = deque(maxlen=8192)  # ids of results already gathered

    def _drop_late_result_messages(self) -> None:
        """Celery's Redis result consumer keeps a READY message that reaches it after the result was
        already resolved (pub/sub delivers it late) in ``_pending_messages`` and never reads it
        again: up to 8,192 results (+21 MiB in the reward bridge of a 30-minute load run,
        ``bench/load.py``). Drop those of results gathered already. The rpc:// backend delivers
        results only as messages, so its buffer is left alone."""
        from celery.backends.redis import RedisBackend

        buffered = getattr(self.app.backend, "_pending_messages", None)
        if buffered is None or not isinstance(self.app.backend, RedisBackend):
            return
        for task_id in self._collected:
            buf = buffered.pop(task_id, None)
            if buf is not None:
                buffered.total -= len(buf)

    async def score(self, items: Sequence[Item]) -> list[Verdict]:
        from celery.result import ResultSet

        async_results = []
        for task, completion, rollout_id in items:
            if task is None:
                async_results.append(None)
                continue
            async_results.append(
                self.task.apply_async(args=[msgspec.to_builtins(task), completion, rollout_id], task_id=rollout_id)
            )
        pending = [r for r in async_results if r is not None]
        values = iter(
            await asyncio.to_thread(ResultSet(pending, app=self.app).join, timeout=self.result_timeout_s, propagate=False)
            if pending
            else []
        )
        out = []
        for r in async_results:
            if r is None:
                out.append(Verdict(0.0, "error", Feedback(message="rollout carries no task: nothing says how to verify it")))
                continue
            value = next(values)
            if isinstance(value, dict):
                fb = value.get("feedback")
                out.append(
                    Verdict(
                        value["reward"],
                        value["verdict"],
                        msgspec.convert(fb, Feedback) if fb else None,
                        value.get("details") or {},
                    )
                )
            else:
                log.error("reward_task_failed", task_id=r.id, error=repr(value)[:300])
                out.append(Verdict(0.0, "infra", Feedback(message=f"reward task failed: {value!r}"[:500])))
            r.forget()
            self._collected.append(r.id)
        self._drop_late_result_messages()  # this batch's, and late ones of earlier batches
        return out

    def close(self) -> None:
        self.app.close()
