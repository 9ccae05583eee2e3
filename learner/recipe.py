"""The GRPO learner recipe: scored topic -> training steps -> weights and progress.

``setup`` happens in ``__init__``, ``run`` trains until stopped, and every
step is one readable function (``_train_step``).

- Batches are built from complete groups (all ``group_size`` samples of a
  task), the oldest policy version first. A group still incomplete after
  ``group_timeout_s`` (a lost sample) is dropped and counted in
  ``groups_incomplete``; it is never trained on half.
- A step waits (up to ``straggler_wait_s``) for an incomplete group whose
  samples would pass ``max_lag`` once the step is taken: one late sample (a
  slow reward task) would otherwise age its whole group out of the window
  while the learner trains on newer groups. Given the workers' admission bound
  (``admission_bound``), it also waits for the oldest attempt the workers
  started that has not arrived at all (``learner/admitted_window.py``). What is
  still missing after the wait no longer holds the learner back.
- Samples older than ``max_lag`` policy versions are dropped and counted,
  or (``stale_decay`` > 0) kept with their advantage scaled by
  ``stale_decay ** (lag - max_lag)`` and counted; the staleness histogram of
  every step is logged.
- Groups with zero reward variance are filtered (dynamic sampling) and
  counted.
- A batch that leaves nothing to train on (every sample stale, filtered or an
  infrastructure failure) is not a step: the version stays, nothing is
  published, and its samples count as consumed. Were it a new version, every
  sample in flight would age by one more version for nothing, and staleness
  would feed itself.
- ``samples_consumed`` (the progress topic's count, against which the rollout
  workers' admission tickets are compared) counts each rollout id once: a
  redelivered duplicate is skipped without counting, as the admission ledger
  counts each task attempt once.
- Every ``publish_every`` steps (and at a clean stop) the policy is written
  to the object store as safetensors under a versioned key (the version is
  the step count) and announced on the weights topic; published versions
  beyond the newest ``keep_versions`` are deleted. Progress (samples consumed, version)
  goes to the progress topic for admission control. A step's weights are copied
  when it ends and stored, announced and reported while the next step trains
  (for a large model, serialising and uploading takes seconds); publications
  stay in order, and a step's progress report never precedes its weights, so
  a worker admitted by it already sees that version.
- Offsets: the position of each partition is the oldest record not yet
  trained on (or dropped), so a crash re-reads what was pending and never
  skips it; rollout ids already trained on are skipped.
- Checkpoints (``checkpoint_every`` steps, ``learner/checkpoint.py``): model,
  optimizer, scheduler, RNG, step, version, positions and the ids trained
  on, written atomically to the object store. With checkpoints on, offsets
  are committed to the broker only after a checkpoint (so the broker never
  runs ahead of durable state) and a restarted learner resumes from the
  newest checkpoint: it seeks to the checkpoint's positions, skips ids the
  checkpoint trained on, and re-trains the steps after it, so in the final
  model's lineage every rollout is trained on exactly once. Policy versions
  stay monotonic across a restart (it continues after the newest version
  in the object store).
- Several ranks (``ranks``, under ``torchrun``; ``learner/distributed.py``):
  this object on rank 0 does all of the above; on every other rank
  ``follow`` runs the collective half of each step (its share of the
  sequences, packs of equal count on every rank), of each weights
  publication and of each checkpoint, as rank 0 commands.
- One process, steps elsewhere (``step_process``; ``learner/step_process.py``):
  the optimizer steps run in a child process that holds the optimizer and
  scheduler; this object keeps everything else and copies each step's
  weights back, so that when every service shares one process (the demo)
  training does not contend for the GIL with the event loop's services.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import Counter
from pathlib import Path

import structlog

from conveyor.admission import AdmissionLedger
from conveyor.contracts import LearnerProgress, ScoredRollout, WeightsAnnouncement, attempt_key
from conveyor.messaging import Delivery, Publisher, ServiceClients, Subscriber
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.transport.base import TopicPartition, Transport
from learner.distributed import RankGroup, full_model_state, full_optimizer_state, load_full_state, split_by_tokens
from learner.grpo import LossConfig, clipped_pg_loss, completion_logprobs, group_advantages
from learner.packing import LogprobHead, pack_sequences, packed_completion_logprobs, shares_prompts

log = structlog.get_logger(__name__)


def _tensor(view: memoryview, dtype):
    """A packed wire array as a tensor (one copy: the record's buffer is read-only)."""
    import torch

    if len(view) == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(bytearray(view), dtype=dtype)


class GRPOLearner:
    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        model,
        pad_id: int,
        store: ObjectStore,
        *,
        run_dir: Path,
        batch_groups: int = 16,
        max_lag: int = 1,
        lr: float = 3e-4,
        loss: LossConfig = LossConfig(),
        group_timeout_s: float = 60.0,
        straggler_wait_s: float = 10.0,
        admission_bound: int | None = None,
        keep_versions: int = 3,
        publish_every: int = 1,
        group_id: str | None = None,
        source=None,
        checkpoint_every: int = 0,
        keep_checkpoints: int = 2,
        warmup_steps: int = 0,
        pack_tokens: int = 4096,
        micro_batch: int = 0,
        stale_decay: float = 0.0,
        ranks: RankGroup | None = None,
        step_process: bool = False,
        updates_per_batch: int = 1,
    ) -> None:
        import torch

        self.transport = transport
        self.topics = topics
        self.ranks = ranks  # several ranks: ``model`` is the FSDP2-sharded root (learner.distributed.shard)
        if ranks is not None:
            if loss.kl_coef > 0:
                raise ValueError("learner.kl_coef > 0 is not supported on several ranks (the frozen reference is not sharded)")
            if pack_tokens <= 0:
                raise ValueError("learner.pack_tokens must be > 0 on several ranks (each rank trains its packs)")
        self._hf = model.model if isinstance(model, LogprobHead) else model  # the HF model: state dicts are its
        if loss.kl_coef > 0:  # the reference is the policy as it starts (before any step)
            import copy

            self._initial_model = copy.deepcopy(model).eval()
        self.source = source  # storage.replay.ReplaySource, or None: the scored topic
        self.model = model
        self.pad_id = pad_id
        self.store = store
        self.run_dir = Path(run_dir)
        self.batch_groups = batch_groups
        self.max_lag = max_lag
        if not 0.0 <= stale_decay < 1.0:
            raise ValueError("stale_decay must be in [0, 1): 0 drops samples older than max_lag")
        self.stale_decay = stale_decay  # > 0: older samples are kept with weight stale_decay ** (lag - max_lag)
        self.loss_cfg = loss
        self.group_timeout_s = group_timeout_s
        self.straggler_wait_s = straggler_wait_s  # 0: never wait for an incomplete group
        # The rollout workers' admission bound ((max_lag + 1) * batch samples): with it, a step also
        # waits for the oldest attempt they started that has not arrived (learner/admitted_window.py).
        self.admission_bound = admission_bound
        self._window = None
        self.keep_versions = keep_versions
        if publish_every < 1:
            raise ValueError("publish_every must be >= 1")
        self.publish_every = publish_every  # steps between weights publications
        if updates_per_batch < 1:
            raise ValueError("learner.updates_per_batch must be >= 1")
        self.updates_per_batch = updates_per_batch  # optimizer updates on each step's batch (PPO epochs)
        self.group_id = group_id or (topics.group("learner") if topics is not None else None)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        warm = max(1, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / warm))
        self.pack_tokens = pack_tokens  # 0: pad to the longest sequence instead of packing
        self.micro_batch = micro_batch  # sequences per forward/backward (gradient accumulation); 0: all
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.resumed_from: int | None = None  # step of the checkpoint this process resumed from
        self._position: dict[TopicPartition, int] = {}  # next offset to read per partition (checkpointed)
        self.trained_log: list[str] = []  # ids trained on, in order (checkpointed; the exactly-once ledger)
        self.version = 0
        self.published_version = 0  # the newest version in the object store and announced
        self.published_key: str | None = None
        self.step = 0
        self.samples_consumed = 0
        self.trained_ids: set[str] = set()
        self.settled_ids: set[str] = set()  # consumed without training (stale, filtered, expired): checkpointed
        self.counters: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()
        self.history: list[dict] = []
        self._groups: dict[str, dict[str, Delivery[ScoredRollout]]] = {}
        self._first_seen: dict[str, float] = {}
        self._waited: set[str] = set()  # incomplete groups a step has waited for (counted once each)
        self._consumed_records: list = []  # records trained on or dropped since the last commit
        self._reported, self._reported_at = 0, 0.0  # samples_consumed last published on the progress topic
        self._last_step: dict = {}  # reward and staleness of the last step, for the progress topic
        self._publishing: asyncio.Task | None = None  # the last step's weights publication and progress report
        self._steps = None  # learner.step_process.StepProcess: the optimizer steps run in a child process
        if step_process:
            if ranks is not None:
                raise ValueError("learner.step_process does not combine with several ranks (each rank already is a process)")
            if any(p.device.type != "cpu" for p in model.parameters()):
                raise ValueError(
                    "learner.step_process is for a CPU learner (the model is on another device, where the "
                    "step leaves the GIL by itself)"
                )
            from learner.step_process import StepProcess

            self._steps = StepProcess(model, pad_id, dict(run_dir=self.run_dir, lr=lr, loss=loss, warmup_steps=warmup_steps,
                                                          pack_tokens=pack_tokens, micro_batch=micro_batch,
                                                          updates_per_batch=updates_per_batch),
                                      threads=torch.get_num_threads())  # fmt: skip
        self._started = time.monotonic()  # the metrics' wall_s (after the step process's start-up)

    # ------------------------------------------------------------------ run
    async def run(self, stop: asyncio.Event) -> None:
        async with ServiceClients(self.transport, self.topics.dead_letter, "learner", heartbeats=self.topics) as io:
            weights_pub: Publisher[WeightsAnnouncement] = io.publisher(self.topics.weights)
            progress_pub: Publisher[LearnerProgress] = io.publisher(self.topics.progress)
            if self.checkpoint_every:
                await asyncio.to_thread(self.resume)
            if self.admission_bound and self.source is None:
                from learner.admitted_window import AdmittedWindow

                ledger = await AdmissionLedger.open(io, self.topics, f"learner-{uuid.uuid4().hex[:8]}")
                await ledger.catch_up()
                self._window = AdmittedWindow(ledger, bound=self.admission_bound, max_lag=self.max_lag,
                                              wait_s=self.straggler_wait_s)  # fmt: skip
                self._window.start(self.samples_consumed)
                # Workers admit against this state until the first report: version 0, nothing consumed.
                self._window.reported(self.version, self.samples_consumed)
            # A replay source (storage/replay.py) stands in for the scored topic when given.
            sub = self.source or await io.subscribe(
                [self.topics.scored], self.group_id, ScoredRollout, on_assigned=self._seek_to_checkpoint
            )
            self._sub = sub
            if self.source is None:  # partitions assigned before the callback could see `sub`
                await self._seek_to_checkpoint(set(sub.consumer.assignment()))
            with (self.run_dir / "metrics.jsonl").open("a") as self.metrics_file:
                await self._loop(stop, sub, weights_pub, progress_pub)
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.command, "stop")
        self.close()

    def close(self) -> None:
        """Stop the step process, if any (the model here keeps the last weights)."""
        if self._steps is not None:
            self._steps.close()  # a step after this raises: the optimizer state was the child's

    def follow(self) -> None:
        """On a rank other than 0: take part in every collective operation rank 0 runs
        (steps, weights gathers, checkpoints, resume) until it says stop."""
        assert self.ranks is not None and not self.ranks.leader
        while True:
            op, payload = self.ranks.command()
            if op == "step":
                self._optimise(payload)
            elif op == "weights":
                self._gather_weights()
            elif op == "checkpoint":
                self._gather_state()
            elif op == "resume":
                if payload is not None:  # rank 0 found a checkpoint: its scheduler state
                    self._load_full({}, {}, payload)
            elif op == "stop":
                return
            else:
                raise RuntimeError(f"unknown learner command {op!r}")

    async def _loop(self, stop: asyncio.Event, sub: Subscriber, weights_pub: Publisher, progress_pub: Publisher) -> None:
        try:
            while not stop.is_set():
                for d in await sub.poll(timeout_s=0.2, max_records=1024):
                    self._add(d)
                if self._window is not None:
                    await self._window.ledger.follow()
                self._expire()
                batch = self._ready_batch()
                if batch is None:
                    # Skipped duplicates and expired groups count as consumed too: report them even
                    # without a step, or producers and workers waiting on credits would stall.
                    if self.samples_consumed != self._reported and time.monotonic() - self._reported_at > 1.0:
                        await self._published()  # a report never overtakes a step's weights
                        await self._publish_progress(progress_pub, self._progress())
                    continue
                stats, state = await asyncio.to_thread(self._step_and_snapshot, batch)
                trained = stats["trained_samples"] > 0
                self.samples_consumed += sum(len(g) for g in batch)
                self._last_step = {"reward_mean": stats["reward_mean"], "max_staleness": stats["max_staleness"]}
                # The previous step's publication had this whole step to finish; publications stay in order.
                await self._published()
                if trained:
                    self.version += 1
                    self._publishing = asyncio.create_task(
                        self._publish_step(weights_pub, progress_pub, state, self.version, self.step, self._progress())
                    )
                else:  # nothing trained: no new version, but the samples are consumed
                    self.counters["batches_untrained"] += 1
                    await self._publish_progress(progress_pub, self._progress())
                self._position.update(self._safe_offsets())
                if not self.checkpoint_every:
                    await sub.commit_offsets(dict(self._position))
                elif trained and self.step % self.checkpoint_every == 0:
                    await self._published()
                    await self.checkpoint(sub)
                self._record(stats)
            await self._published()
            if self.published_version != self.version and self.step != self.resumed_from:
                await self._publish_weights(weights_pub)  # the final policy is always in the store
            if self.checkpoint_every and self.step != self.resumed_from:
                await self.checkpoint(sub)  # a clean stop leaves nothing to re-train
        finally:
            if self._publishing is not None and not self._publishing.done():
                self._publishing.cancel()
                await asyncio.gather(self._publishing, return_exceptions=True)

    def _step_and_snapshot(self, batch: list[list[ScoredRollout]]) -> tuple[dict, dict | None]:
        """One step, then (on a publishing step) a copy of the new weights, taken before the
        next step can change them: serialising, storing and announcing it overlap that step."""
        stats = self._train_step(batch)
        if not stats["trained_samples"] or self.step % self.publish_every:
            return stats, None
        live = {t.data_ptr() for t in (*self._hf.parameters(), *self._hf.buffers())}
        # Tensors that are the live parameters are copied; gathered ones (several ranks) are already copies.
        return stats, {k: v.to("cpu", copy=v.data_ptr() in live) for k, v in self._weights_state().items()}

    async def _publish_step(self, weights_pub: Publisher, progress_pub: Publisher, state: dict | None, version: int,
                            step: int, progress: dict) -> None:  # fmt: skip
        """A step's weights (if it publishes), then its progress report: a worker admitted by the
        report can already see the version trained before it, which keeps staleness within max_lag."""
        if state is not None:
            await self._publish_weights(weights_pub, state, version, step)
        await self._publish_progress(progress_pub, progress)

    async def _published(self) -> None:
        """Wait for the step publication in flight, if any (its error, if it failed, is raised here)."""
        task, self._publishing = self._publishing, None
        if task is not None:
            await task

    def _progress(self) -> dict:
        return {"samples_consumed": self.samples_consumed, "policy_version": self.version, "step": self.step, **self._last_step}

    async def _publish_progress(self, pub: Publisher, progress: dict) -> None:
        await pub.publish_and_wait(LearnerProgress(run_id=self.topics.run_id, **progress), key=self.topics.run_id)
        if self._window is not None:
            self._window.reported(progress["policy_version"], progress["samples_consumed"])
        self._reported, self._reported_at = progress["samples_consumed"], time.monotonic()

    # -------------------------------------------------------------- batching
    def _add(self, d: Delivery[ScoredRollout]) -> None:
        s = d.message
        if s.rollout_id in self.trained_ids or s.rollout_id in self.settled_ids:
            # Counted when first consumed; the admission ledger counts its attempt once too.
            self.counters["duplicates_skipped"] += 1
            self._consumed_records.append(d.record)
            return
        task_id = s.rollout.task_id
        group = self._groups.setdefault(task_id, {})
        if s.rollout_id in group:  # a second copy while its group is still forming
            self.counters["duplicates_skipped"] += 1
            self._consumed_records.append(d.record)
            return
        group[s.rollout_id] = d
        self._first_seen.setdefault(task_id, time.monotonic())

    def _expire(self) -> None:
        now = time.monotonic()
        for task_id, first in list(self._first_seen.items()):
            group = self._groups[task_id]
            size = next(iter(group.values())).message.rollout.group_size
            if len(group) < size and now - first > self.group_timeout_s:
                self.counters["groups_incomplete"] += 1
                log.warning("learner.group_incomplete", task_id=task_id, have=len(group), want=size)
                self._consumed_records.extend(d.record for d in group.values())
                self.settled_ids.update(group)
                self._consumed_attempt(group)
                self.samples_consumed += len(group)
                del self._groups[task_id], self._first_seen[task_id]
                self._waited.discard(task_id)

    def _ready_batch(self) -> list[list[ScoredRollout]] | None:
        complete = [t for t, g in self._groups.items() if len(g) >= next(iter(g.values())).message.rollout.group_size]
        if len(complete) < self.batch_groups or self._waiting_for_straggler(complete) or self._window_holds():
            return None
        # Oldest policy first, then arrival: records of several partitions arrive interleaved
        # by partition, not in the order they were generated, and a newer group trained
        # ahead of an older one would push the older one past max_lag.
        complete.sort(key=lambda t: (min(d.message.rollout.min_policy_version for d in self._groups[t].values()),
                                     self._first_seen[t]))  # fmt: skip
        batch = []
        for task_id in complete[: self.batch_groups]:
            group = self._groups.pop(task_id)
            del self._first_seen[task_id]
            self._waited.discard(task_id)
            self._consumed_attempt(group)
            self._consumed_records.extend(d.record for d in group.values())
            batch.append([d.message for d in group.values()])
        return batch

    def _consumed_attempt(self, group: dict) -> None:
        if self._window is not None and group:
            r = next(iter(group.values())).message.rollout
            self._window.consumed(attempt_key(r.task_id, r.attempt))

    def _window_holds(self) -> bool:
        if self._window is None:
            return False
        present = {attempt_key(task_id, next(iter(g.values())).message.rollout.attempt) for task_id, g in self._groups.items()}
        if self._window.hold(self.version, self.samples_consumed, present):
            self.counters["admitted_attempts_waited"] = self._window.waits
            return True
        return False

    def _waiting_for_straggler(self, complete: list[str]) -> bool:
        """Whether an incomplete group, seen less than ``straggler_wait_s`` ago, has samples that the
        next step would make older than ``max_lag`` (generated at ``version - max_lag`` or before)."""
        if not self.straggler_wait_s:
            return False
        now, done = time.monotonic(), set(complete)
        for task_id, group in self._groups.items():
            if task_id in done or now - self._first_seen[task_id] > self.straggler_wait_s:
                continue
            if min(d.message.rollout.min_policy_version for d in group.values()) <= self.version - self.max_lag:
                if task_id not in self._waited:
                    self._waited.add(task_id)
                    self.counters["straggler_groups_waited"] += 1
                return True
        return False

    def _safe_offsets(self) -> dict[TopicPartition, int]:
        """Commit up to the oldest record still pending in a group, per partition."""
        pending_min: dict[TopicPartition, int] = {}
        for group in self._groups.values():
            for d in group.values():
                tp = d.record.tp
                pending_min[tp] = min(pending_min.get(tp, d.record.offset), d.record.offset)
        done_max: dict[TopicPartition, int] = {}
        for r in self._consumed_records:
            done_max[r.tp] = max(done_max.get(r.tp, -1), r.offset)
        self._consumed_records = []
        out = {}
        for tp, last in done_max.items():
            out[tp] = min(last + 1, pending_min.get(tp, last + 1))
        return out

    # ------------------------------------------------------------- training
    def _train_step(self, batch: list[list[ScoredRollout]]) -> dict:
        import torch

        t0 = time.monotonic()
        prompts, completions, behaviour, advantages, masks, fresh, temps = [], [], [], [], [], [], []
        rewards = []
        step_staleness: Counter[int] = Counter()
        for group in batch:
            rewards.extend(s.reward for s in group)
            kept, weights = [], []
            for s in group:
                lag = self.version - s.rollout.min_policy_version
                step_staleness[lag] += 1
                weight = 1.0
                if lag > self.max_lag:
                    if not self.stale_decay:
                        self.counters["samples_stale_dropped"] += 1
                        self.settled_ids.add(s.rollout_id)
                        continue
                    weight = self.stale_decay ** (lag - self.max_lag)
                    self.counters["samples_stale_downweighted"] += 1
                if s.verdict == "infra":  # the reward service failed, not the model: no signal
                    self.counters["samples_infra_dropped"] += 1
                    self.settled_ids.add(s.rollout_id)
                    continue
                kept.append(s)
                weights.append(weight)
            if len(kept) < 2:
                self.counters["samples_group_too_small"] += len(kept)
                self.settled_ids.update(s.rollout_id for s in kept)
                continue
            adv = group_advantages([s.reward for s in kept], self.loss_cfg.std_normalise)
            if adv is None:
                self.counters["groups_zero_variance"] += 1
                self.counters["samples_zero_variance"] += len(kept)
                self.settled_ids.update(s.rollout_id for s in kept)
                continue
            for s, a, w in zip(kept, adv, weights):
                a *= w  # a stale sample's say in the update shrinks with its age
                r = s.rollout
                prompts.append(r.prompt_token_ids.tolist())
                completions.append(r.completion_token_ids.tolist())
                behaviour.append(_tensor(r.behaviour_logprobs, torch.float32))
                fresh.append(r.min_policy_version == r.max_policy_version == self.version)
                temp = r.task.sampling.temperature if r.task is not None and r.task.sampling is not None else 1.0
                temps.append(temp if temp > 0 else 1.0)  # (a greedy sample has no sampled distribution)
                masks.append(_tensor(r.loss_mask, torch.uint8).float())
                advantages.append(a)
                self.trained_ids.add(r.rollout_id)
                self.trained_log.append(r.rollout_id)
        self.staleness.update(step_staleness)
        stats: dict = {"loss": None, "importance_mean": None, "importance_max": None, "clip_fraction": None}
        tokens = 0
        if prompts:
            work = dict(prompts=prompts, completions=completions, behaviour=behaviour, advantages=advantages, masks=masks,
                        fresh=fresh, temps=temps)  # fmt: skip
            if self.ranks is not None:
                self.ranks.command("step", work)
            stats.update(self._optimise(work))
            tokens = int(stats["tokens"])
            self.step += 1  # a batch with nothing to train on is not a step (no update, no new version)
        elapsed = time.monotonic() - t0
        stats.update(
            reward_mean=sum(rewards) / max(len(rewards), 1),
            samples=len(rewards),
            trained_samples=len(prompts),
            staleness={str(k): v for k, v in sorted(step_staleness.items())},
            max_staleness=max(step_staleness) if step_staleness else 0,
            tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
            step_s=elapsed,
        )
        return stats

    def _optimise(self, work: dict) -> dict:
        """``updates_per_batch`` optimizer updates on the step's sequences (on several ranks, every
        rank runs them on the same ``work`` and trains its share).

        Every update clips against the same behaviour log-probabilities (and, for the decoupled
        objective, the same proximal ones, taken before the first update), so later updates stay
        within the clip range of the policy that sampled the batch, as PPO's epochs do. The
        statistics are the first update's (its importance weights measure the samples'
        staleness), with the last update's clip fraction and importance mean beside them. The
        learning-rate schedule advances once per step, whatever the number of updates."""
        import torch

        if self._steps is not None:
            stats, weights = self._steps.step(work)
            self._copy_weights(weights)
            return stats
        prox_cache: list = []
        for update in range(self.updates_per_batch):
            loss, stats = self._accumulate(**work, prox_cache=prox_cache)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            if hasattr(grad_norm, "full_tensor"):  # sharded gradients: the norm is a replicated DTensor
                grad_norm = grad_norm.full_tensor()
            self.optimizer.step()
            if update == 0:
                first = dict(stats, loss=loss, grad_norm=float(grad_norm), lr=self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        if self.updates_per_batch > 1:
            first.update(updates=self.updates_per_batch, last_clip_fraction=stats["clip_fraction"],
                         last_importance_mean=stats["importance_mean"])  # fmt: skip
        return first

    def _copy_weights(self, weights: bytes) -> None:
        """Take the step process's new weights (as ``_gather_weights`` gives them) into this model."""
        import torch
        from safetensors.torch import load

        live = self._hf.state_dict()
        with torch.no_grad():
            for name, tensor in load(weights).items():
                live[name].copy_(tensor)

    def _micro_batches(self, prompts, completions) -> list[list[int]]:
        """Sequence indices of each forward/backward pass this process runs.

        One process: ``micro_batch`` sequences at a time (0: all). Several ranks: this rank's
        share (token-balanced) one pack at a time, then empty passes up to the largest pack
        count of any rank: FSDP gathers parameters and reduces gradients in every pass, so every
        rank must run the same number."""
        n = len(prompts)
        if self.ranks is None:
            size = self.micro_batch or n
            return [list(range(lo, min(lo + size, n))) for lo in range(0, n, size)]
        per_rank = []
        for share in split_by_tokens([len(p) + len(c) for p, c in zip(prompts, completions)], self.ranks.world):
            packs = pack_sequences([prompts[i] for i in share], [completions[i] for i in share], self.pack_tokens,
                                   share_prompts=shares_prompts(self.model))  # fmt: skip
            per_rank.append([[share[i] for i, *_ in pack.spans] for pack in packs])
        passes = max(len(r) for r in per_rank)
        mine = per_rank[self.ranks.rank]
        return mine + [[] for _ in range(passes - len(mine))]

    def _logprobs(self, prompts, completions, temps, entropy=None, token_entropies=None):
        import torch

        device_type = next(self.model.parameters()).device.type
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device_type == "cuda"):  # bf16 matmuls, fp32 log-softmax
            if self.pack_tokens:
                return packed_completion_logprobs(self.model, prompts, completions, pack_tokens=self.pack_tokens,
                                                  entropy=entropy, temperatures=temps, token_entropies=token_entropies)  # fmt: skip
            return completion_logprobs(self.model, prompts, completions, self.pad_id, entropy=entropy, temperatures=temps,
                                       token_entropies=token_entropies)  # fmt: skip

    def _accumulate(
        self, prompts, completions, behaviour, advantages, masks, fresh=None, temps=None, prox_cache: list | None = None
    ) -> tuple[float, dict]:
        """Forward and backward over ``_micro_batches``; the gradients equal one pass over the whole
        batch (each part is normalised by the batch's totals; on several ranks each rank's part is
        scaled by the rank count, as FSDP averages gradients over ranks).

        ``fresh[i]``: sample i was generated by exactly the current weights, so the gap between
        its behaviour logprobs and the learner's is the train/inference mismatch (engine numerics,
        kernels, precision), reported as ``logprob_mismatch_mean/max``. ``temps[i]``: sample i's
        sampling temperature; every log-probability is taken under ``softmax(logits / T)``, the
        distribution the behaviour logprobs are of. ``prox_cache``: the decoupled objective's
        proximal log-probabilities per micro-batch, filled by the first call and reused by later
        ones on the same batch (the proximal policy is the one before the step's first update)."""
        import torch

        n = len(prompts)
        world = self.ranks.world if self.ranks is not None else 1
        device = next(self.model.parameters()).device
        behaviour = [b.to(device) for b in behaviour]
        masks = [m.to(device) for m in masks]
        agg_tokens = float(sum(float(m.sum()) for m in masks))
        denominator = agg_tokens if self.loss_cfg.aggregation == "token" else float(n)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, parts, entropies = 0.0, [], []
        mismatch = [0.0, 0, 0.0]  # sum, tokens, max
        for part, idx in enumerate(self._micro_batches(prompts, completions)):
            if not idx:  # this rank has no pack left: a pass that contributes nothing joins the collectives
                idx, zero = [0], True
            else:
                zero = False
            pick = lambda xs, idx=idx: [xs[i] for i in idx]  # noqa: E731
            p, c = pick(prompts), pick(completions)
            t = pick(temps) if temps else None
            prox = ref = None
            if self.loss_cfg.objective == "decoupled":
                if prox_cache is not None and part < len(prox_cache):
                    prox = prox_cache[part]  # a later update on this batch: the step's proximal policy
                else:
                    with torch.no_grad():  # the proximal policy: current weights, before this step's updates
                        self.model.eval()
                        prox = [x.float() for x in self._logprobs(p, c, t)]
                    if prox_cache is not None:
                        prox_cache.append(prox)
            if self.loss_cfg.kl_coef > 0:
                with torch.no_grad():
                    ref = completion_logprobs(self._reference_model(), p, c, self.pad_id, temperatures=t)
            self.model.train()
            ent: list[float] = []
            tok_ents = [] if self.loss_cfg.entropy_coef > 0 else None  # per-token entropies for the bonus
            new = [x.float() for x in self._logprobs(p, c, t, ent, tok_ents)]
            if zero:
                (sum(x.sum() for x in new) * 0.0).backward()
                continue
            for j, i in enumerate(idx):
                if fresh and fresh[i]:
                    gap = (new[j].detach() - behaviour[i]).abs()[masks[i] > 0]
                    if gap.numel():
                        mismatch[0] += float(gap.sum())
                        mismatch[1] += gap.numel()
                        mismatch[2] = max(mismatch[2], float(gap.max()))
            loss, st = clipped_pg_loss(new, pick(behaviour), pick(advantages), pick(masks), self.loss_cfg, prox, ref, denominator,
                                       tok_ents)  # fmt: skip
            (loss * world).backward()
            total_loss += float(loss.detach())
            parts.append(st)
            entropies.append(ent[0])
        if self.ranks is not None:  # every rank's statistics, merged
            gathered = self.ranks.gather((total_loss, parts, entropies, mismatch))
            total_loss = sum(g[0] for g in gathered)
            parts = [st for g in gathered for st in g[1]]
            entropies = [e for g in gathered for e in g[2]]
            mismatch = [sum(g[3][0] for g in gathered), sum(g[3][1] for g in gathered), max(g[3][2] for g in gathered)]
        tokens = sum(st["tokens"] for st in parts)
        weighted = lambda k: sum(st[k] * st["tokens"] for st in parts) / max(tokens, 1)  # noqa: E731
        stats = {
            "importance_mean": weighted("importance_mean"),
            "importance_max": max(st["importance_max"] for st in parts),
            "clip_fraction": weighted("clip_fraction"),
            "tokens": tokens,
            "entropy": sum(entropies) / len(entropies),
            "micro_batches": len(parts),
        }
        if mismatch[1]:
            stats.update(logprob_mismatch_mean=mismatch[0] / mismatch[1], logprob_mismatch_max=mismatch[2],
                         logprob_mismatch_tokens=mismatch[1])  # fmt: skip
        if any("kl" in st for st in parts):
            stats["kl"] = weighted("kl")
        return total_loss, stats

    def _reference_model(self):
        """A frozen copy of the starting policy (for the KL penalty), made on first use."""
        if getattr(self, "_ref", None) is None:
            import copy

            self._ref = copy.deepcopy(self._initial_model).eval()
            for p in self._ref.parameters():
                p.requires_grad_(False)
        return self._ref

    async def _publish_weights(self, pub: Publisher[WeightsAnnouncement], state: dict | None = None,
                               version: int | None = None, step: int | None = None) -> None:  # fmt: skip
        """Store and announce ``state`` as ``version`` (default: the weights, version and step now)."""
        from safetensors.torch import save

        if state is None:
            state = await asyncio.to_thread(self._weights_state)
        version = self.version if version is None else version
        step = self.step if step is None else step
        data = await asyncio.to_thread(save, state)
        key = f"runs/{self.topics.run_id}/weights/v{version:06d}/model.safetensors"
        info = await asyncio.to_thread(self.store.put, key, data)
        await pub.publish_and_wait(
            WeightsAnnouncement(
                run_id=self.topics.run_id, version=version, key=key, uri=self.store.uri(key), sha256=info.sha256 or "", step=step
            ),
            key=self.topics.run_id,
        )
        self.published_version, self.published_key = version, key
        await asyncio.to_thread(self._prune_versions)

    def _published_versions(self) -> list[int]:
        return sorted(int(m.group(1)) for i in self.store.list(f"runs/{self.topics.run_id}/weights/")
                      if (m := re.search(r"/weights/v(\d+)/", i.key)))  # fmt: skip

    def _prune_versions(self) -> None:
        """Delete published versions but the newest ``keep_versions`` (listed, so versions left by
        an earlier process of this run go too)."""
        for old in self._published_versions()[: -self.keep_versions]:
            self.store.delete(f"runs/{self.topics.run_id}/weights/v{old:06d}/model.safetensors")

    def _weights_state(self) -> dict:
        if self.ranks is not None:
            self.ranks.command("weights")
        return self._gather_weights()

    def _gather_weights(self) -> dict:
        """The policy's tensors as a Hugging Face checkpoint stores them (a tied LM head once),
        gathered from every rank's shards on several ranks (collective: every rank calls it)."""
        state = full_model_state(self._hf)
        if getattr(getattr(self._hf, "config", None), "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return {k: v.detach().contiguous() for k, v in state.items()}

    def _gather_state(self) -> tuple[dict, dict]:
        """Full, FQN-keyed model and optimizer state (collective: every rank calls it, in this order)."""
        return full_model_state(self._hf), full_optimizer_state(self._hf, self.optimizer)

    # ---------------------------------------------------------- checkpoints
    def _latest_published_version(self) -> int:
        return max(self._published_versions(), default=0)

    def resume(self) -> bool:
        """Load the newest checkpoint, if any; returns whether one was loaded."""
        from learner.checkpoint import load_latest

        state = load_latest(self.store, self.topics.run_id)
        if state is None:
            if self.ranks is not None:
                self.ranks.command("resume", None)
            return False
        if state.get("layout") == "full-fqn":
            if self.ranks is not None:
                self.ranks.command("resume", state["scheduler"])
            self._load_full(state["model"], state["optimizer"], state["scheduler"])
        else:  # written by a single-process learner before checkpoints were FQN-keyed
            if self.ranks is not None:
                raise RuntimeError("this checkpoint predates multi-rank checkpoints: resume it on one process")
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        if self._steps is not None:  # the child trains on: it resumes from what was loaded here
            self._steps.load(*self._gather_state(), self.scheduler.state_dict())
        self.step = self.resumed_from = state["step"]
        # Versions the lost steps announced must not be reused for other weights.
        self.version = max(state["version"], self._latest_published_version())
        self.samples_consumed = state["samples_consumed"]
        self.trained_log = list(state["trained_log"])
        self.trained_ids = set(self.trained_log)
        self.settled_ids = set(state.get("settled_ids", ()))
        self.counters = Counter(state["counters"])
        self._position = {TopicPartition(t, p): o for (t, p), o in state["position"].items()}
        log.info("learner.resumed", step=self.step, version=self.version, trained=len(self.trained_log))
        return True

    def _load_full(self, model_state: dict, optimizer_state: dict, scheduler_state: dict) -> None:
        load_full_state(self._hf, self.optimizer, model_state, optimizer_state)  # rank 0's, broadcast
        self.scheduler.load_state_dict(scheduler_state)

    async def _seek_to_checkpoint(self, assigned: set[TopicPartition]) -> None:
        sub = getattr(self, "_sub", None)
        consumer = sub.consumer if sub is not None else None
        for tp in assigned:
            if tp in self._position and consumer is not None:
                consumer.seek(tp, self._position[tp])

    async def checkpoint(self, sub=None) -> str:
        from learner.checkpoint import save_checkpoint

        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.command, "checkpoint")
        # Full, FQN-keyed state dicts (gathered from every rank): a checkpoint written by N ranks resumes on M.
        if self._steps is not None:  # the child's optimizer and scheduler are the ones that step
            model_state, optimizer_state, scheduler_state = await asyncio.to_thread(self._steps.state)
        else:
            model_state, optimizer_state = await asyncio.to_thread(self._gather_state)
            scheduler_state = self.scheduler.state_dict()
        state = {
            "layout": "full-fqn",
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": scheduler_state,
            "step": self.step,
            "version": self.version,
            "samples_consumed": self.samples_consumed,
            "trained_log": list(self.trained_log),
            "settled_ids": sorted(self.settled_ids),
            "counters": dict(self.counters),
            "position": {(tp.topic, tp.partition): o for tp, o in self._position.items()},
        }
        key = await asyncio.to_thread(save_checkpoint, self.store, self.topics.run_id, state, self.step, self.keep_checkpoints)
        if sub is not None:
            await sub.commit_offsets(dict(self._position))  # the broker never runs ahead of a checkpoint
        return key

    def _record(self, stats: dict) -> None:
        row = {"step": self.step, "version": self.version, "wall_s": time.monotonic() - self._started, **stats, **self.counters}
        self.history.append(row)
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
