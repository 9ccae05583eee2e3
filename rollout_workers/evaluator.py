"""The evaluator service (``conveyor serve evaluator``): held-out evaluation during a run.

It follows the weights topic like a rollout worker, and every ``eval.every`` versions loads the
newest announced one into an engine of its own and runs the held-out tasks through it
(``rollout_workers/evaluation.py``: the same engines and verifiers as the run). Each evaluation is
a line of ``eval.jsonl`` (in the run directory, and under ``runs/<run>/meta/`` in the object store):
version, seconds since the evaluator started, pass@1, pass@k, mean reward and length — the
held-out curve of ``conveyor report``.

It runs in its own process, so evaluating never takes the learner's or the rollout workers' time,
and it takes no part in admission: it claims nothing and reports nothing to the learner.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import structlog

from conveyor import keys
from conveyor.contracts import Task, WeightsAnnouncement
from conveyor.messaging import ClaimCheck, ServiceClients
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.transport.base import Transport
from rollout_workers.evaluation import evaluate

log = structlog.get_logger(__name__)


class EvaluatorService:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        store: ObjectStore,
        engine,
        sandbox,
        tasks: list[Task],
        *,
        every: int,
        run_dir: Path,
        k: int = 1,
        samples: int | None = None,
        max_tokens: int = 512,
        stop: tuple[str, ...] = (),
        claim_check: ClaimCheck | None = None,
        tracker=None,
    ) -> None:
        self.claim_check = claim_check  # messages over its threshold travel through the object store
        self.tracker = tracker  # an experiment tracker (started by the caller): each row, at its version
        if every < 1:
            raise ValueError("eval.every must be >= 1")
        self.transport, self.topics, self.store = transport, topics, store
        self.engine, self.sandbox, self.tasks = engine, sandbox, tasks
        self.every, self.k, self.samples = every, k, samples
        self.max_tokens, self.stop = max_tokens, stop
        self.path = Path(run_dir) / "eval.jsonl"
        self.rows: list[dict] = []
        self.evaluated = -1  # the last version evaluated

    async def run(self, stop: asyncio.Event) -> None:
        started = time.monotonic()
        await self.engine.start()
        async with ServiceClients(
            self.transport, self.topics.dead_letter, "evaluator", heartbeats=self.topics, claim_check=self.claim_check
        ) as io:
            await io.transport.create_topics(self.topics.shared_specs())
            weights = await io.subscribe([self.topics.weights], None, WeightsAnnouncement)
            await self._evaluate(started)  # the policy the run starts from
            newest: WeightsAnnouncement | None = None
            while not stop.is_set():
                for d in await weights.poll(timeout_s=0.5, max_records=1000):
                    if newest is None or d.message.version > newest.version:
                        newest = d.message
                if newest is not None and newest.version >= self.evaluated + self.every:
                    try:
                        data = await asyncio.to_thread(self.store.get, newest.key, sha256=newest.sha256)
                        await self.engine.swap(data, newest.version)
                    except Exception as exc:  # noqa: BLE001 - a version pruned or refused: the next one is tried
                        log.warning("evaluator.version_unavailable", version=newest.version, error=str(exc))
                        self.evaluated = newest.version - self.every + 1  # wait for a newer one
                        continue
                    await self._evaluate(started)
        await self.engine.close()
        if self.tracker is not None:
            await asyncio.to_thread(self.tracker.close)

    async def _evaluate(self, started: float) -> None:
        version = self.engine.version
        report = await evaluate(self.engine, self.sandbox, self.tasks, k=self.k, samples=self.samples,
                                max_tokens=self.max_tokens, stop=self.stop)  # fmt: skip
        row = {"version": version, "wall_s": round(time.monotonic() - started, 2), "pass_rate": report.pass_at_1,
               **{k: v for k, v in report.summary().items() if k in ("pass_at_k", "k", "mean_reward", "mean_tokens", "tasks")}}  # fmt: skip
        self.rows.append(row)
        self.evaluated = version
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        text = "".join(json.dumps(r) + "\n" for r in self.rows)
        await asyncio.to_thread(self.store.put, keys.meta_key(self.topics.run_id, "eval.jsonl"), text.encode())
        log.info("evaluator.evaluated", **row)
        if self.tracker is not None:
            self.tracker.log_eval(row, step=version)
