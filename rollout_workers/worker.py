"""Rollout worker: tasks topic -> engine -> rollouts topic.

- The engine is kept full: every admitted task is its own request to the
  engine (``n = group_size`` samples), submitted as soon as it is admitted,
  up to ``max_inflight_tasks`` at once; vLLM batches them continuously, the
  reference engine batches whatever arrived while its last batch ran.
  Finished groups are published in admission order (one that finished early
  waits for older ones), so the learner consumes samples in the order
  admission control counted them.
- Admission control is global (``conveyor/admission.py``): every task the
  worker polls is claimed on the run's admission ledger, which gives each
  attempt a ticket in one order shared by every worker; an attempt starts only
  when ``ticket - consumed <= (max_lag + 1) * learner_batch``, with
  ``consumed`` read from the learner's progress topic. However many workers
  run, and after any restart, the pipeline never runs more than ``max_lag``
  versions ahead of what the learner can use.
- Start-up: before it takes a task, the worker reads the weights topic, the
  progress topic and the ledger to their ends, and serves the newest published
  version (a restarted worker never generates with the initial policy, nor
  tries versions the learner has pruned since).
- Weight swaps: announcements on the weights topic are followed between
  polls: the safetensors object is fetched from the object store, its sha256
  checked, and handed to the engine, which swaps without waiting for the
  requests in flight (vLLM) or between batches (reference engine). Every
  rollout records which version produced which tokens. A missing, corrupt or
  misfitting weights object is refused (logged, counted) and the worker keeps
  serving its current version.
- Offsets of the tasks topic are committed in order, only up to the first
  task whose rollouts are not yet acknowledged by the broker; a crash
  regenerates the uncommitted tasks under the same deterministic
  ``rollout_id`` values. An engine failure ends the worker with the error
  (the process exits non-zero; its tasks are redelivered to another worker).
- One task never stops a worker: a task it cannot serve is dead-lettered and
  answered with ``error`` rollouts (``rollout_workers/refusals.py``), and so is
  an attempt that workers already claimed ``max_task_claims`` times without
  finishing it (it was probably what killed them).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog
from opentelemetry import trace

from conveyor import keys
from conveyor.admission import AdmissionLedger, admissible
from conveyor.contracts import (
    LearnerProgress,
    Rollout,
    SamplingParams,
    Task,
    Timings,
    VersionSegment,
    WeightsAnnouncement,
    attempt_key,
    rollout_id,
)
from conveyor.errors import ChecksumMismatch
from conveyor.images import load_image
from conveyor.limits import MAX_GROUP_SIZE
from conveyor.messaging import ClaimCheck, Delivery, Publisher, ServiceClients, Subscriber
from conveyor.metrics import process_rollout_metrics
from conveyor.objectstore import ObjectNotFound, ObjectStore, ObjectStoreUnavailable
from conveyor.topics import Topics
from conveyor.tracing import headers_of, start_child
from conveyor.transport.base import CommitFailed, TopicPartition, Transport
from rollout_workers.engine import (
    BatchingEngine,
    Completion,
    SamplingRequest,
    WeightsRejected,
    check_finite,
    cut_at_stop_strings,
    stop_rules,
)
from rollout_workers.multiturn import run_episodes
from rollout_workers.refusals import TaskLimits, TaskRefused, error_rollouts, prompt_refusal, refusal

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
        max_inflight_tasks: int | None = None,
        group_id: str | None = None,
        scorer=None,
        max_context_tokens: int | None = None,
        metrics=None,
        tool_sandbox=None,
        default_sampling: SamplingParams | None = None,
        max_group_size: int = MAX_GROUP_SIZE,
        max_task_claims: int = 5,
        drain_timeout_s: float = 30.0,
        claim_check: ClaimCheck | None = None,
    ) -> None:
        self.claim_check = claim_check  # messages over its threshold travel through the object store
        self.transport = transport
        self.topics = topics
        # A synchronous batch engine (reference) gets the async interface.
        self.engine = engine if engine is None or hasattr(engine, "swap") else BatchingEngine(engine)
        self.store = store
        self.learner_batch_samples = learner_batch_samples
        self.max_lag = max_lag
        self.tasks_per_batch = tasks_per_batch
        self.max_inflight_tasks = max_inflight_tasks or tasks_per_batch
        self.group_id = group_id or topics.group("rollout-workers")
        self.scorer = scorer  # executes attempts of multi-turn tasks (the reward service)
        self.tool_sandbox = tool_sandbox  # runs tool turns of terminal tasks in persistent workspaces
        # For a task that carries no sampling: the run config's (rollout_workers/build.py); built
        # directly (tests, benchmarks), short completions.
        self.default_sampling = default_sampling or SamplingParams(max_tokens=16)
        self.max_context_tokens = max_context_tokens or getattr(self.engine, "max_context", None) or 4096
        self.limits = TaskLimits(
            max_group_size=max_group_size,
            max_context_tokens=self.max_context_tokens,
            max_claims=max_task_claims,
            top_p=getattr(self.engine, "supports_top_p", True),
            vision=getattr(self.engine, "reads_images", False),
        )
        self.tasks_refused = 0
        self.drain_timeout_s = drain_timeout_s  # a stop waits this long for the tasks in flight
        self.worker_id = uuid.uuid4().hex[:8]
        self.generated = 0
        """Rollouts published (acknowledged by the broker)."""
        self.consumed = 0
        """Samples the learner had consumed when it published the version this worker serves:
        what admission counts against. A worker that has not swapped to the newest version yet
        must not admit as if it had (its samples start one version older)."""
        self._consumed_at: dict[int, int] = {}  # policy version -> samples consumed reported with it
        self.tokens = 0
        self.swaps = 0
        self.swaps_refused = 0
        self.swap_seconds: list[float] = []
        self.metrics = metrics or process_rollout_metrics()  # Prometheus, when the process serves metrics
        self._held_since: float | None = None  # admission has held every task back since then
        self._trace_headers: dict[str, tuple] = {}  # task attempt -> its generate span's context, until published

    @property
    def bound(self) -> int:
        """Samples the whole pipeline may hold between the start of generation and the learner."""
        return (self.max_lag + 1) * self.learner_batch_samples

    async def run(self, stop: asyncio.Event) -> None:
        await self.engine.start()
        async with ServiceClients(
            self.transport, self.topics.dead_letter, "rollout-worker", heartbeats=self.topics, claim_check=self.claim_check
        ) as io:
            publisher: Publisher[Rollout] = io.publisher(self.topics.rollouts)
            # Every worker reads every announcement, progress report and claim: readers in no group
            # (the topics are created here if this worker starts before the producer and the learner).
            await io.transport.create_topics(self.topics.shared_specs())
            weights = await io.subscribe([self.topics.weights], None, WeightsAnnouncement)
            progress = await io.subscribe([self.topics.progress], None, LearnerProgress)
            self.ledger = await AdmissionLedger.open(io, self.topics, f"rw-{self.worker_id}")
            await self._catch_up(weights, progress)
            tasks = self._tasks = await io.subscribe([self.topics.tasks], self.group_id, Task)
            waiting: list[list] = []  # [delivery, rollouts | None, published] polled, not yet started
            order: list[list] = []  # entries in start (= ticket) order: the order they are published in
            polled_order: list[list] = []  # every entry in poll order: the order offsets are committed in
            running: dict[asyncio.Task, list] = {}
            try:
                while not stop.is_set():
                    await self._follow(weights, progress)
                    await self.ledger.follow()
                    room = self.max_inflight_tasks - len(running) - len(waiting)
                    if room > 0:
                        # Idle, the wait for tasks is also the wait for weights: short, so an announced
                        # version is served within ~50 ms even when no task comes.
                        polled = [
                            [d, None, False]
                            for d in await tasks.poll(timeout_s=0 if running or waiting else 0.05, max_records=room)
                        ]
                        if polled:
                            await self.ledger.claim([(_key(e[0].message), e[0].message.group_size) for e in polled])
                        waiting += polled
                        polled_order += polled
                    started = self._start_admitted(waiting, running)
                    order += started
                    self._observe(running, waiting, held=bool(waiting) and not started and not running)
                    if running:
                        done, _ = await asyncio.wait(running, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                        self._collect(done, running)
                        await self._publish_ready(order, polled_order, publisher, tasks)
                    elif waiting:  # not admitted yet: wake on the learner's next report or a claim read back
                        await self._follow(weights, progress, wait_s=0.05)
                # Drain: what is in flight is finished, published and committed; tasks polled but
                # never started stay uncommitted (another worker gets them, under their tickets).
                deadline = time.monotonic() + self.drain_timeout_s
                while running:
                    left = deadline - time.monotonic()
                    done, _ = await asyncio.wait(running, timeout=max(left, 0), return_when=asyncio.FIRST_COMPLETED)
                    if not done:  # an engine that stopped answering: what is unfinished stays uncommitted
                        log.warning("rollout_worker.drain_abandoned", unfinished_tasks=len(running),
                                    seconds=self.drain_timeout_s)  # fmt: skip
                        break
                    self._collect(done, running)
                await self._publish_ready(order, polled_order, publisher, tasks)
            finally:
                for t in running:  # on failure: nothing half-done keeps running
                    t.cancel()
                await asyncio.gather(*running, return_exceptions=True)

    def _observe(self, running: dict, waiting: list[list], held: bool) -> None:
        """Prometheus gauges of the loop's state; ``held``: tasks wait for admission and none runs."""
        if not self.metrics:
            return
        now = time.monotonic()
        if held and self._held_since is not None:
            self.metrics.admission_wait.inc(now - self._held_since)
        self._held_since = now if held else None
        self.metrics.running.set(len(running))
        self.metrics.sequences.set(sum(e[0].message.group_size for e in running.values()))
        self.metrics.waiting.set(len(waiting))

    def _start_admitted(self, waiting: list[list], running: dict) -> list[list]:
        """Start waiting tasks in ticket order while their tickets are within the bound; returns the
        entries started. A task whose claim has not come back yet waits: its ticket will be later
        than every ticket known now."""
        waiting.sort(key=lambda e: self.ledger.ticket(_key(e[0].message)) or float("inf"))
        started = []
        # A task refused on its face generates nothing, so admission does not hold it back: a group
        # larger than the whole admission window would otherwise wait for ever, and every task
        # behind it too.
        for entry in [e for e in waiting if self._refusal(e[0].message) is not None]:
            waiting.remove(entry)
            running[asyncio.create_task(self._sample_or_refuse(entry[0]))] = entry
            started.append(entry)
        while waiting and len(running) < self.max_inflight_tasks:
            ticket = self.ledger.ticket(_key(waiting[0][0].message))
            if ticket is None or not admissible(ticket, self.consumed, self.bound):
                break
            entry = waiting.pop(0)
            running[asyncio.create_task(self._sample_or_refuse(entry[0]))] = entry
            started.append(entry)
        return started

    async def _catch_up(self, weights: Subscriber, progress: Subscriber, deadline_s: float = 60.0) -> None:
        """Read the weights and progress topics and the admission ledger to their ends and take the
        newest version, before any task is taken."""
        until = time.monotonic() + deadline_s
        newest: list[WeightsAnnouncement] = []
        for sub in (weights, progress):
            while time.monotonic() < until:
                got = await sub.poll(timeout_s=0.2, max_records=10_000)
                if sub is weights:
                    newest = sorted([*newest, *(d.message for d in got)], key=lambda a: a.version)[-3:]
                else:
                    self._take_progress([d.message for d in got])
                if await sub.caught_up():
                    break
        await self.ledger.catch_up(max(1.0, until - time.monotonic()))
        for ann in reversed(newest):  # the newest; an older one only if it was refused (three at most)
            if ann.version <= self.engine.version or await self._swap(ann):
                break
        self._take_progress([])
        log.info("rollout_worker.caught_up", version=self.engine.version, consumed=self.consumed,
                 claimed=self.ledger.claimed_samples)  # fmt: skip

    def _collect(self, done, running: dict) -> None:
        for t in done:
            running.pop(t)[1] = t.result()  # an engine failure ends the worker here

    async def _publish_ready(self, order: list[list], polled_order: list[list], publisher: Publisher[Rollout],
                             tasks: Subscriber) -> None:  # fmt: skip
        """Publish the finished prefix of ``order`` (groups leave in ticket order: one that finished
        early waits for the older ones, so the learner consumes them in the order admission
        counted them), then commit, per partition, the tasks of ``polled_order`` up to the first one
        not published yet: a task polled and still waiting for admission is never committed past,
        so a crash regenerates it. Tasks of partitions a rebalance moved away are not committed:
        their new owner re-reads them (same rollout ids, absorbed downstream)."""
        ready = 0
        while ready < len(order) and order[ready][1] is not None:
            ready += 1
        if not ready:
            return
        entries = order[:ready]
        del order[:ready]
        futures = [await publisher.publish(r, r.task_id, headers) for e in entries
                   for headers in [self._trace_headers.pop(_key(e[0].message), ())] for r in e[1]]  # fmt: skip
        await asyncio.gather(*futures)
        for e in entries:
            e[2] = True
        self.generated += len(futures)
        blocked: set[TopicPartition] = set()
        done, keep = [], []
        for e in polled_order:
            tp = TopicPartition(e[0].record.topic, e[0].record.partition)
            if e[2] and tp not in blocked:
                done.append(e[0])
            else:
                blocked.add(tp)
                keep.append(e)
        polled_order[:] = keep
        assigned = tasks.assignment()
        mine = [d for d in done if TopicPartition(d.record.topic, d.record.partition) in assigned]
        try:
            if mine:
                await tasks.commit(mine)
        except CommitFailed as exc:
            log.warning("rollout_worker.commit_after_rebalance", tasks=len(mine), error=str(exc)[:200])

    async def _follow(self, weights: Subscriber, progress: Subscriber, wait_s: float = 0.0) -> None:
        """Take in the learner's progress (waiting up to ``wait_s`` for a report) and swap to the newest
        announced version. A step's weights are announced before its progress report, so a worker
        admitted by a report already sees that version."""
        for d in await progress.poll(timeout_s=wait_s, max_records=1000):
            self._take_progress([d.message])
        announced = [d.message for d in await weights.poll(timeout_s=0, max_records=1000)]
        # Newest first; a refused version falls back to the next newer-than-current one.
        for ann in sorted(announced, key=lambda a: a.version, reverse=True):
            if ann.version <= self.engine.version or await self._swap(ann):
                break
        self._take_progress([])  # the served version may be newer now

    def _take_progress(self, reports: list[LearnerProgress]) -> None:
        """Take in progress reports and set ``consumed`` to what was consumed by the served version."""
        for r in reports:
            v = r.policy_version
            self._consumed_at[v] = max(self._consumed_at.get(v, 0), r.samples_consumed)
        served = self.engine.version
        older = [v for v in self._consumed_at if v <= served]
        if older:
            self.consumed = max(self.consumed, max(self._consumed_at[v] for v in older))
            for v in older:
                if v < served:
                    del self._consumed_at[v]

    async def _swap(self, ann: WeightsAnnouncement) -> bool:
        started = time.monotonic()
        try:
            if ann.run_id != self.topics.run_id or keys.weights_key(ann.run_id, ann.version) != ann.key:
                # Only the learner's own key for that version: never a path another role chose.
                raise WeightsRejected(f"announcement names {ann.key!r}, not this run's weights of version {ann.version}")
            data = await asyncio.to_thread(self.store.get, ann.key, sha256=ann.sha256)
            await asyncio.to_thread(check_finite, data)
            await self.engine.swap(data, ann.version)
        except (ObjectNotFound, ChecksumMismatch, WeightsRejected, ObjectStoreUnavailable) as exc:
            # The next announcement is tried afresh; until then the current version serves.
            self.swaps_refused += 1
            if self.metrics:
                self.metrics.swaps_refused.inc()
            log.error("rollout_worker.swap_refused", version=ann.version, key=ann.key, error=str(exc),
                      serving=self.engine.version)  # fmt: skip
            return False
        self.swaps += 1
        self.swap_seconds.append(time.monotonic() - started)
        if self.metrics:
            self.metrics.swap_seconds.observe(self.swap_seconds[-1])
            self.metrics.policy_version.set(ann.version)
        log.info("rollout_worker.swapped", version=ann.version, seconds=round(self.swap_seconds[-1], 3))
        return True

    async def _sample_or_refuse(self, delivery: Delivery[Task]) -> list[Rollout]:
        """The task's rollouts, under a ``generate`` span of the task's trace (its context goes on
        the rollouts' records)."""
        task = delivery.message
        span = start_child("generate", delivery.record.headers, **{"conveyor.task_id": task.task_id,
                                                                    "conveyor.group_size": task.group_size})  # fmt: skip
        try:
            with trace.use_span(span, end_on_exit=False):  # its log lines carry the trace id
                rollouts = await self._generate_or_refuse(delivery)
            span.set_attribute("conveyor.policy_version", self.engine.version)
            return rollouts
        finally:
            span.end()
            if headers := headers_of(span):  # a traced task: its rollouts carry the span on
                self._trace_headers[_key(task)] = headers

    async def _generate_or_refuse(self, delivery: Delivery[Task]) -> list[Rollout]:
        """The task's rollouts; for a task this worker refuses (``rollout_workers/refusals.py``),
        its dead letter and ``error`` rollouts. An engine failure still ends the worker."""
        task = delivery.message
        sp = task.sampling or self.default_sampling
        reason = self._refusal(task)
        if reason is None:
            try:
                return await self._sample(task, sp)
            except ValueError as exc:  # the engine refused this request (validation), not an engine failure
                reason = f"the engine refused the request: {exc}"
        self.tasks_refused += 1
        log.warning("rollout_worker.task_refused", task_id=task.task_id, attempt=task.attempt, reason=reason[:300])
        await self._tasks.dead_letter(delivery, "TaskRefused", reason)
        return error_rollouts(task, reason, self.engine.version)

    def _refusal(self, task: Task) -> str | None:
        return refusal(task, task.sampling or self.default_sampling, self.ledger.claims(_key(task)), self.limits)

    async def _sample(self, task: Task, sp: SamplingParams) -> list[Rollout]:
        started = time.time()
        stop_ids, stop_texts = stop_rules(sp.stop, self.engine.encode)
        prompt = self.engine.encode_prompt(task.prompt, task.messages, task.tools)
        too_long = prompt_refusal(len(prompt), sp, self.limits)
        if too_long:
            raise TaskRefused(too_long)
        greedy = sp.temperature == 0  # temperature 0 means greedy, as in vLLM and the OpenAI API
        pictures = await self._pictures(task) if task.images else ()
        request = SamplingRequest(
            prompt,
            images=pictures,
            n=task.group_size,
            max_tokens=sp.max_tokens,
            temperature=1.0 if greedy else sp.temperature,
            top_p=sp.top_p,
            stop_token_ids=stop_ids,
            greedy=greedy,
            request_id=f"{task.task_id}/{task.attempt}/{self.worker_id}",
        )
        tools = self.tool_sandbox is not None and task.verifier.kind == "terminal"
        environment = task.verifier.kind == "environment"  # a machine environment's runs on the tool sandbox
        if task.max_turns > 1 and (self.scorer is not None or tools or environment):
            results = await run_episodes(self.engine, self.scorer, task, prompt, request,
                                         max_context_tokens=self.max_context_tokens, episode_id=request.request_id,
                                         sandbox=self.tool_sandbox if tools or environment else None,
                                         stop_texts=stop_texts)  # fmt: skip
            finished = time.time()
            return [self._rollout(task, prompt, i, c, started, finished, e.loss_mask, e.turns)
                    for i, (c, e) in enumerate(results)]  # fmt: skip
        if task.max_turns > 1:
            log.warning("rollout_worker.single_turn", task_id=task.task_id, reason="no scorer configured for multi-turn tasks")
        completions = await self.engine.generate(request)
        if stop_texts:  # stop strings of several tokens are found in the text
            completions = [cut_at_stop_strings(c, stop_texts, self.engine.decode) for c in completions]
        finished = time.time()
        return [self._rollout(task, prompt, i, c, started, finished) for i, c in enumerate(completions)]

    async def _pictures(self, task: Task) -> tuple:
        """The task's images, read from the object store (digests checked). One that is missing,
        altered or undecodable refuses the task; a store that does not answer is retried as any
        other store outage is."""

        def read() -> tuple:
            out = []
            for img in task.images:
                try:
                    out.append(load_image(self.store, img))
                except (ObjectNotFound, ChecksumMismatch, OSError, ValueError) as exc:
                    raise TaskRefused(f"image {img.key}: {exc}") from None
            return tuple(out)

        return await asyncio.to_thread(read)

    def _rollout(self, task: Task, prompt: list[int], i: int, c: Completion, started: float, finished: float,
                 loss_mask: list[int] | None = None, turns: list | None = None) -> Rollout:  # fmt: skip
        self.tokens += len(c.token_ids)
        if self.metrics:
            self.metrics.tokens.inc(len(c.token_ids))
        return Rollout(
            rollout_id=rollout_id(task.task_id, i, task.attempt),
            task_id=task.task_id,
            run_id=task.run_id,
            sample_index=i,
            attempt=task.attempt,
            group_size=task.group_size,
            prompt_token_ids=prompt,
            completion_token_ids=c.token_ids,
            behaviour_logprobs=c.logprobs,
            loss_mask=loss_mask if loss_mask is not None else [1] * len(c.token_ids),
            turns=turns or [],
            version_segments=[VersionSegment(start=a, end=b, policy_version=v) for a, b, v in c.version_segments()],
            finish_reason=c.finish_reason,  # type: ignore[arg-type]
            timings=Timings(generation_started_at=started, generation_finished_at=finished),
            task=task,
        )


def _key(task: Task) -> str:
    return attempt_key(task.task_id, task.attempt)
