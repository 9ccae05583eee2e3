"""The GRPO learner recipe: scored topic -> training steps -> weights and progress.

``GRPOLearner`` composes the learner's parts, configured by one ``LearnerConfig`` section
(conveyor/config.py): ``Batcher`` (``learner/batching.py``: complete groups into batches, straggler
waits, the ledger of rollout ids, safe offsets), ``prepare`` (``learner/preparation.py``:
staleness, filters and advantages), a trainer (``learner/trainer.py``, or
``learner/step_process.py`` with ``step_process``), ``Publication`` (``learner/publication.py``:
weights and progress) and checkpoints (``learner/checkpoint.py``). Setup happens in ``__init__``,
``run`` trains until stopped, and every step is one readable function (``train_step``).

- A batch that leaves nothing to train on (every sample stale, filtered or an infrastructure
  failure) is not a step: the version stays, nothing is published, and its samples count as
  consumed. Were it a new version, every sample in flight would age by one more version for
  nothing, and staleness would feed itself.
- ``samples_consumed`` (the progress topic's count, against which the rollout workers'
  admission tickets are compared) counts each rollout id once: a redelivered duplicate is
  skipped without counting, as the admission ledger counts each task attempt once.
- Every ``publish_every`` steps (and at a clean stop) the policy is published (the version is
  the step count). A step's weights are copied when it ends and stored, announced and reported
  while the next step trains; a step's progress report never precedes its weights.
- Offsets: without checkpoints (``checkpoint_every`` 0) each step commits the batcher's safe
  position; with them, offsets are committed only after a checkpoint, and a restarted learner
  resumes from the newest one (the exactly-once rules are ``learner/checkpoint.py``'s).
- Rebalances: exactly-once rests on the ledger of trained ids and the position, not on the
  broker. A commit a rebalance refused (the learner was dropped from its group: a step longer
  than ``transport.max_poll_interval_ms``) is counted (``commits_after_rebalance``) and the
  learner carries on; when its partitions come back it seeks them to its own position, and
  what is delivered again is skipped by the ledger.
- One learner per run: it trains only while it holds every partition of the scored topic. A
  second learner started by mistake in its group takes some (the group rebalances): then
  neither trains, publishes nor commits (``rebalance_waits``, a warning naming the group) until
  one of them leaves, rather than two lineages each training on half the topic under the same
  version numbers and checkpoint keys. (A scored topic of one partition is not split: whichever
  holds it trains, from its own state, and the other waits.)
- Several ranks (``ranks``, under ``torchrun``; ``learner/distributed.py``): this object on rank 0
  does all of the above; every other rank runs only a ``Trainer``'s ``follow``, the collective
  half of each step, weights publication and checkpoint, as rank 0's trainer commands.
- One process, steps elsewhere (``step_process``): the optimizer steps run in a child process
  that holds the optimizer and scheduler; this object keeps everything else and each step's
  weights are copied back, so that when every service shares one process (the demo) training
  does not contend for the GIL with the event loop's services.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter, deque
from pathlib import Path

import structlog

from conveyor import adapters, keys
from conveyor.admission import AdmissionLedger
from conveyor.config import LearnerConfig
from conveyor.contracts import ImagePart, ScoredRollout
from conveyor.errors import ConfigError
from conveyor.images import load_image
from conveyor.messaging import ClaimCheck, ServiceClients, Subscriber
from conveyor.metrics import process_learner_metrics
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.tracing import by_trace, start_child
from conveyor.tracking import Tracker
from conveyor.transport.base import CommitFailed, TopicPartition, Transport
from learner.admitted_window import AdmittedWindow
from learner.batching import Batcher
from learner.checkpoint import restore_checkpoint, write_checkpoint
from learner.distributed import RankGroup
from learner.preparation import prepare
from learner.publication import Publication, publish_dtype
from learner.step_process import StepProcess
from learner.trainer import Trainer

log = structlog.get_logger(__name__)


class GRPOLearner:
    """The learner service (the module's docstring).

    ``config``: the run config's ``learner`` section (default: ``LearnerConfig()``).
    ``admission_bound``: the rollout workers' admission bound (``(max_lag + 1) * batch samples``);
    with it, a batch also waits for the oldest attempt they started that has not arrived
    (``learner/admitted_window.py``). ``source``: a replay source (``storage/replay.py``) read
    instead of the scored topic. ``ranks``: this process's place among several ranks (``model``
    is then the FSDP2-sharded root, ``learner.distributed.shard``)."""

    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        model,
        pad_id: int,
        store: ObjectStore,
        config: LearnerConfig | None = None,
        *,
        run_dir: Path,
        admission_bound: int | None = None,
        group_id: str | None = None,
        source=None,
        ranks: RankGroup | None = None,
        claim_check: ClaimCheck | None = None,
        tracker: Tracker | None = None,
        vision=None,
    ) -> None:
        self.claim_check = claim_check  # messages over its threshold travel through the object store
        self.config = config = config if config is not None else LearnerConfig()
        self.transport = transport
        self.topics = topics
        self.store = store
        self.run_dir = Path(run_dir)
        self.admission_bound = admission_bound
        self.group_id = group_id or topics.group("learner")
        self.source = source
        if vision is not None:  # a vision-language model's steps take pixels: in this process
            self.trainer: Trainer | StepProcess = Trainer(model, pad_id, config, ranks=ranks, vision=vision)
        else:
            if config.step_process:  # optimizer steps in a child process
                self.trainer = StepProcess(model, pad_id, config, ranks=ranks)
            else:
                self.trainer = Trainer(model, pad_id, config, ranks=ranks, store=store)
        self.counters: Counter[str] = Counter()  # why samples were dropped, waited for, skipped (the metrics' columns)
        self.batcher = Batcher(config, self.counters)
        on_gpu = next(iter(model.parameters())).is_cuda if model is not None else False
        lora = config.lora
        self.publication = Publication(
            store, topics.run_id, config.keep_versions, publish_dtype(config.publish_dtype, on_gpu=on_gpu),
            metadata=adapters.metadata(lora.rank, lora.alpha, lora.target_modules) if lora else None,
        )  # fmt: skip
        self.resumed_from: int | None = None  # step of the checkpoint this process resumed from
        self.version = 0
        self.step = 0
        self.samples_consumed = 0
        self.staleness: Counter[int] = Counter()
        self.history: deque[dict] = deque(maxlen=100)  # the latest steps' rows (metrics.jsonl has them all)
        self._last_step: dict = {}  # reward and staleness of the last step, for the progress topic
        self._sub: Subscriber | None = None
        self._scored_partitions: set[TopicPartition] | None = None  # every partition of the scored topic
        self._partitions_missing: set[TopicPartition] = set()
        self._started = time.monotonic()  # the metrics' wall_s (after the step process's start-up)
        self.prometheus = process_learner_metrics()  # the step rows as Prometheus series, when the process serves them
        self.tracker = tracker  # an experiment tracker (started by the caller): the step rows and the final model

    @property
    def model(self):
        """The policy (with ``step_process``: the parent's copy, updated after every step)."""
        return self.trainer.model

    @property
    def published_version(self) -> int:
        """The newest version in the object store and announced."""
        return self.publication.version

    @property
    def published_key(self) -> str | None:
        return self.publication.key

    # ------------------------------------------------------------------ run
    async def run(self, stop: asyncio.Event) -> None:
        async with ServiceClients(
            self.transport, self.topics.dead_letter, "learner", heartbeats=self.topics, claim_check=self.claim_check
        ) as io:
            self.publication.connect(io.publisher(self.topics.weights), io.publisher(self.topics.progress))
            if self.config.checkpoint_every:
                await asyncio.to_thread(self.resume)
            elif self.source is None:
                await asyncio.to_thread(self._refuse_to_restart_without_checkpoints)
            if self.admission_bound and self.source is None:
                ledger = await AdmissionLedger.open(io, self.topics, f"learner-{uuid.uuid4().hex[:8]}")
                await ledger.catch_up()
                window = AdmittedWindow(ledger, bound=self.admission_bound, max_lag=self.config.max_lag,
                                        wait_s=self.config.straggler_wait_s)  # fmt: skip
                window.start(self.samples_consumed)
                # Workers admit against this state until the first report: version 0, nothing consumed.
                window.reported(self.version, self.samples_consumed)
                self.batcher.window, self.publication.on_report = window, window.reported
            # A replay source (storage/replay.py) stands in for the scored topic when given.
            sub = self.source or await io.subscribe(
                [self.topics.scored], self.group_id, ScoredRollout, on_assigned=self._seek_to_checkpoint
            )
            self._sub = sub
            if self.source is None:  # partitions assigned before the callback could see `sub`
                await self._seek_to_checkpoint(set(sub.consumer.assignment()))
            if self.prometheus is not None:
                self.prometheus.start(self.counters)  # after a resume: its counts so far are not this process's
            with (self.run_dir / "metrics.jsonl").open("a") as self._metrics:
                await self._loop(stop, sub)
        if self.tracker is not None and self.publication.key is not None:
            self.tracker.log_model(self.store.uri(self.publication.key))
        await asyncio.to_thread(self.close)

    def _refuse_to_restart_without_checkpoints(self) -> None:
        """Without checkpoints, offsets are committed every step: a learner started again on a run
        that already trained would take up the stream where its predecessor stopped, from the
        initial policy, and publish versions that already exist."""
        published = next(iter(self.store.list(keys.weights_prefix(self.topics.run_id))), None)
        if published is not None:
            raise ConfigError(
                f"run {self.topics.run_id!r} already has published weights ({published.key}) and learner.checkpoint_every "
                "is 0: a learner cannot resume without checkpoints; start a new run_id, or set checkpoint_every >= 1"
            )

    def close(self) -> None:
        """Stop the trainer: the step process, if any (the model here keeps the last weights), or
        the other ranks; then flush the tracker."""
        self.trainer.close()
        if self.tracker is not None:
            self.tracker.close()

    async def _loop(self, stop: asyncio.Event, sub: Subscriber) -> None:
        pub, every = self.publication, self.config.checkpoint_every
        idle_since = time.monotonic()  # the end of the last step: from here the learner waits for data
        try:
            while not stop.is_set():
                for d in await sub.poll(timeout_s=0.2, max_records=1024):
                    self.batcher.add(d)
                if self.batcher.window is not None:
                    await self.batcher.window.ledger.follow()
                self.samples_consumed += self.batcher.expire()
                if await self._partitions_elsewhere(sub):
                    continue  # joining, rebalancing, or a second learner holds some
                batch = self.batcher.ready(self.version, self.samples_consumed)
                if batch is None:
                    # Skipped duplicates and expired groups count as consumed too: report them even
                    # without a step, or producers and workers waiting on credits would stall.
                    if self.samples_consumed != pub.reported and time.monotonic() - pub.reported_at > 1.0:
                        await pub.wait()  # a report never overtakes a step's weights
                        await pub.report(self.progress())
                    continue
                waited = time.monotonic() - idle_since
                # A train span per traced task of the batch (under one of its samples' score spans).
                spans = [start_child("train", h, **{"conveyor.task_id": ids[0], "conveyor.samples": len(ids)})
                         for h, ids in by_trace(self.batcher.batch_trace).values()]  # fmt: skip
                stats, state = await asyncio.to_thread(self._step_and_snapshot, batch)
                for span in spans:
                    span.set_attributes({"conveyor.step": self.step, "conveyor.trained": stats["trained_samples"] > 0})
                    span.end()
                trained = stats["trained_samples"] > 0
                self.samples_consumed += sum(len(g) for g in batch)
                self._last_step = {"reward_mean": stats["reward_mean"], "max_staleness": stats["max_staleness"]}
                held_from = time.monotonic()
                # The previous step's publication had this whole step to finish; publications stay in order.
                await pub.wait()
                if trained:
                    self.version += 1
                    pub.start(state, self.version, self.step, self.progress())
                else:  # nothing trained: no new version, but the samples are consumed
                    self.counters["batches_untrained"] += 1
                    await pub.report(self.progress())
                position = self.batcher.advance()
                if not every:
                    await self._commit(sub, position)
                elif trained and self.step % every == 0:
                    await pub.wait()
                    await self.checkpoint(sub)
                # The step's time split: waiting for a batch, computing it (step_s), and held by the
                # previous publication, the progress report, the commit or a checkpoint.
                stats.update(wait_s=waited, publish_s=time.monotonic() - held_from)
                self._record(stats)
                idle_since = time.monotonic()
            await pub.wait()
            if pub.version != self.version and self.step != self.resumed_from:
                # The final policy is always in the store.
                await pub.publish(await asyncio.to_thread(self.trainer.weights), self.version, self.step)
            if every and self.step != (self.resumed_from or 0):
                # A clean stop leaves nothing to re-train; one that trained nothing here (a second
                # learner that waited all along) leaves the newest checkpoint as it is.
                await self.checkpoint(sub)
        finally:
            await pub.cancel()

    def _step_and_snapshot(self, batch: list[list[ScoredRollout]]) -> tuple[dict, dict | None]:
        """One step, then (on a publishing step) a copy of the new weights, taken before the
        next step can change them: serialising, storing and announcing it overlap that step."""
        stats = self.train_step(batch)
        if not stats["trained_samples"] or self.step % self.config.publish_every:
            return stats, None
        return stats, self.trainer.snapshot()

    def progress(self) -> dict:
        """What the progress topic reports now."""
        return {"samples_consumed": self.samples_consumed, "policy_version": self.version, "step": self.step, **self._last_step}

    # ------------------------------------------------------------- training
    def _pictures(self, refs: list[list[ImagePart]]) -> list[list]:
        """Each sample's images from the store (digests checked), each distinct image read once."""
        seen: dict[str, object] = {}
        for row in refs:
            for r in row:
                if r.sha256 not in seen:
                    seen[r.sha256] = load_image(self.store, r)
        return [[seen[r.sha256] for r in row] for row in refs]

    def train_step(self, batch: list[list[ScoredRollout]]) -> dict:
        """One step on ``batch`` (complete groups) from the current version: its statistics. A batch
        with nothing to train on is not a step (no update; ``step`` stays)."""
        t0 = time.monotonic()
        prepared = prepare(batch, self.version, self.config)
        self.batcher.mark_settled(prepared.settled)
        self.batcher.mark_trained(prepared.trained)
        self.counters.update(prepared.counts)
        self.staleness.update(prepared.staleness)
        stats: dict = {"loss": None, "importance_mean": None, "importance_max": None, "clip_fraction": None}
        tokens = 0
        if prepared.work is not None:
            if "images" in prepared.work:
                prepared.work["images"] = self._pictures(prepared.work["images"])
            stats.update(self.trainer.step(prepared.work))
            tokens = int(stats["tokens"])
            self.step += 1
        elapsed = time.monotonic() - t0
        stats.update(prepared.stats(), tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0, step_s=elapsed)
        return stats

    def _record(self, stats: dict) -> None:
        row = {"step": self.step, "version": self.version, "wall_s": time.monotonic() - self._started, **stats, **self.counters}
        self.history.append(row)
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self.prometheus is not None:
            self.prometheus.observe(row, self.counters)
        if self.tracker is not None:
            self.tracker.log(self.step, row)

    # ---------------------------------------------------------- checkpoints
    async def checkpoint(self, sub: Subscriber | None = None) -> str:
        """Write a checkpoint now; with ``sub``, then commit the position it holds (the broker never
        runs ahead of a checkpoint). Its key."""
        progress = {"step": self.step, "version": self.version, "samples_consumed": self.samples_consumed,
                    "counters": dict(self.counters), **self.batcher.state()}  # fmt: skip
        key = await write_checkpoint(self.store, self.topics.run_id, self.trainer, progress, step=self.step,
                                     keep=self.config.keep_checkpoints)  # fmt: skip
        if sub is not None:
            await self._commit(sub, dict(self.batcher.position))
        return key

    def resume(self) -> bool:
        """Load the newest checkpoint, if any; returns whether one was loaded."""
        state = restore_checkpoint(self.store, self.topics.run_id, self.trainer)
        if state is None:
            return False
        self.step = self.resumed_from = state["step"]
        # Versions the lost steps announced must not be reused for other weights.
        self.version = max(state["version"], self.publication.latest())
        self.samples_consumed = state["samples_consumed"]
        self.batcher.load(state)
        self.counters.clear()
        self.counters.update(state["counters"])
        log.info("learner.resumed", step=self.step, version=self.version, trained=len(self.batcher.trained_log))
        return True

    # ---------------------------------------------------------- rebalances
    async def _commit(self, sub: Subscriber, offsets: dict[TopicPartition, int]) -> None:
        """Commit ``offsets`` of the partitions this learner still holds. What a rebalance moved is
        not committed: whoever reads it next reads it again, and this learner's ledger skips it."""
        held = offsets if self.source is not None else {tp: o for tp, o in offsets.items() if tp in sub.assignment()}
        error = ""
        try:
            await sub.commit_offsets(held)
        except CommitFailed as exc:  # dropped from the group (or moved) between the check and the commit
            held, error = {}, str(exc)[:200]
        if len(held) < len(offsets):
            self.counters["commits_after_rebalance"] += 1
            log.warning("learner.commit_after_rebalance", partitions=len(offsets) - len(held), error=error)

    async def _partitions_elsewhere(self, sub: Subscriber) -> bool:
        """Whether this learner lacks a partition of the scored topic: while it joins or its group
        rebalances, or while another member (a second learner) holds some. It then takes no step."""
        if self.source is not None:
            return False
        assigned = sub.assignment()
        if not assigned:
            return True
        if self._scored_partitions is None:  # the topic exists now: a reader in no group is assigned all of it
            reader = self.transport.consumer([self.topics.scored], None, from_beginning=False)
            await reader.start()
            self._scored_partitions = reader.assignment()
            await reader.close()
        missing = self._scored_partitions - assigned
        if missing and missing != self._partitions_missing:
            self.counters["rebalance_waits"] += 1
            log.warning("learner.partitions_elsewhere", group=self.group_id, missing=sorted(tp.partition for tp in missing),
                        hint="one learner per run: another member of its group holds these; it trains again once it "
                        "holds them all")  # fmt: skip
        self._partitions_missing = missing
        return bool(missing)

    async def _seek_to_checkpoint(self, assigned: set[TopicPartition]) -> None:
        consumer = self._sub.consumer if self._sub is not None else None
        position = self.batcher.position
        for tp in assigned:
            if tp in position and consumer is not None:
                consumer.seek(tp, position[tp])
