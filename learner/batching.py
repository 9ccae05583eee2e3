"""The learner's batches: scored deliveries in, batches of complete groups out, and safe offsets.

- Batches are built from complete groups (all ``group_size`` samples of a task), the oldest
  policy version first, then arrival: records of several partitions arrive interleaved by
  partition, not in the order they were generated, and a newer group trained ahead of an older
  one would push the older one past ``max_lag``. A group still incomplete after
  ``group_timeout_s`` (a lost sample) is dropped and counted in ``groups_incomplete``; it is
  never trained on half.
- A batch waits (up to ``straggler_wait_s``) for an incomplete group whose samples would pass
  ``max_lag`` once the step is taken: one late sample (a slow reward task) would otherwise age
  its whole group out of the window while the learner trains on newer groups. Given the
  workers' admission bound, it also waits for the oldest attempt the workers started that has
  not arrived at all (``window``: ``learner/admitted_window.py``). What is still missing after
  the wait no longer holds the learner back.
- The ledger of rollout ids: the most recent ``DEDUPE_WINDOW`` trained on, in order
  (``trained_log``: checkpointed) and consumed without training (``settled_ids``: stale,
  filtered, expired). A redelivered duplicate of either, or a second copy while its group is
  still forming, is skipped and counted in ``duplicates_skipped``, never counted consumed again
  (the admission ledger counts each task attempt once too). The window is bounded, so neither
  memory nor checkpoints grow with the run: exactly-once rests on the offsets (the position is
  checkpointed with the weights, and nothing before it is read again), and the window only has
  to catch the copies a publisher re-sends when it redoes uncommitted work (a bridge or worker
  restarted or rebalanced: at most its in-flight rollouts, thousands, long before 100,000 more
  ids arrive). A copy older than that would also be older than ``max_lag`` versions.
- Offsets: the position of each partition is the oldest record not yet trained on (or
  dropped), so a crash re-reads what was pending and never skips it.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict

import structlog

from conveyor.config import LearnerConfig
from conveyor.contracts import ScoredRollout, attempt_key
from conveyor.limits import RECENT_IDS
from conveyor.messaging import Delivery
from conveyor.transport.base import TopicPartition
from learner.admitted_window import AdmittedWindow

log = structlog.get_logger(__name__)
DEDUPE_WINDOW = RECENT_IDS


class RecentIds:
    """The last ``maxlen`` ids added, in order, with set membership."""

    def __init__(self, ids=(), maxlen: int = DEDUPE_WINDOW) -> None:
        self.maxlen = maxlen
        self._ids: OrderedDict[str, None] = OrderedDict()
        self.update(ids)

    def update(self, ids) -> None:
        for i in ids:
            self._ids[i] = None
            self._ids.move_to_end(i)
        while len(self._ids) > self.maxlen:
            self._ids.popitem(last=False)

    def __contains__(self, rid: object) -> bool:
        return rid in self._ids

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class Batcher:
    """Groups forming from scored deliveries, the batches they make, and the offsets safe to commit.

    ``counters`` (shared with the learner's metrics) counts duplicates, expired groups and waits."""

    def __init__(self, config: LearnerConfig, counters: Counter[str] | None = None) -> None:
        self.config = config
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.window: AdmittedWindow | None = None  # the workers' admitted attempts, with an admission bound
        self.position: dict[TopicPartition, int] = {}  # next offset to read per partition (checkpointed)
        self.trained_ids = RecentIds()  # the latest ids trained on, in order (checkpointed)
        self.settled_ids = RecentIds()  # consumed without training (stale, filtered, expired): checkpointed
        self._groups: dict[str, dict[str, Delivery[ScoredRollout]]] = {}
        self._first_seen: dict[str, float] = {}
        self._waited: set[str] = set()  # incomplete groups a batch has waited for (counted once each)
        self._consumed_records: list = []  # records trained on or dropped since the last commit
        self.batch_trace: list[tuple[str, tuple]] = []  # the last batch's traced samples: (task id, record headers)

    # ------------------------------------------------------------ deliveries
    def add(self, d: Delivery[ScoredRollout]) -> None:
        """Take a scored rollout into its group (a duplicate is skipped and counted)."""
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

    def expire(self) -> int:
        """Drop the groups still incomplete after ``group_timeout_s``; the samples they settled."""
        now, settled = time.monotonic(), 0
        for task_id, first in list(self._first_seen.items()):
            group = self._groups[task_id]
            size = next(iter(group.values())).message.rollout.group_size
            if len(group) < size and now - first > self.config.group_timeout_s:
                self.counters["groups_incomplete"] += 1
                log.warning("learner.group_incomplete", task_id=task_id, have=len(group), want=size)
                self._consumed_records.extend(d.record for d in group.values())
                self.settled_ids.update(group)
                self._consumed_attempt(group)
                settled += len(group)
                del self._groups[task_id], self._first_seen[task_id]
                self._waited.discard(task_id)
        return settled

    def ready(self, version: int, consumed: int = 0) -> list[list[ScoredRollout]] | None:
        """The next batch of ``batch_groups`` complete groups, oldest policy first, for a step from
        ``version`` (``consumed``: the samples consumed so far, for the admitted window); None while
        there are too few, or a straggler or an admitted attempt is worth waiting for."""
        complete = [t for t, g in self._groups.items() if len(g) >= next(iter(g.values())).message.rollout.group_size]
        if len(complete) < self.config.batch_groups:
            return None
        if self._waiting_for_straggler(complete, version) or self._window_holds(version, consumed):
            return None
        complete.sort(key=lambda t: (min(d.message.rollout.min_policy_version for d in self._groups[t].values()),
                                     self._first_seen[t]))  # fmt: skip
        batch = []
        self.batch_trace = []
        for task_id in complete[: self.config.batch_groups]:
            group = self._groups.pop(task_id)
            del self._first_seen[task_id]
            self._waited.discard(task_id)
            self._consumed_attempt(group)
            self._consumed_records.extend(d.record for d in group.values())
            batch.append([d.message for d in group.values()])
            self.batch_trace += [(task_id, d.record.headers) for d in group.values() if d.record.headers]
        return batch

    def _consumed_attempt(self, group: dict) -> None:
        if self.window is not None and group:
            r = next(iter(group.values())).message.rollout
            self.window.consumed(attempt_key(r.task_id, r.attempt))

    def _window_holds(self, version: int, consumed: int) -> bool:
        if self.window is None:
            return False
        present = {attempt_key(task_id, next(iter(g.values())).message.rollout.attempt) for task_id, g in self._groups.items()}
        if self.window.hold(version, consumed, present):
            self.counters["admitted_attempts_waited"] = self.window.waits
            return True
        return False

    def _waiting_for_straggler(self, complete: list[str], version: int) -> bool:
        """Whether an incomplete group, seen less than ``straggler_wait_s`` ago, has samples that the
        next step would make older than ``max_lag`` (generated at ``version - max_lag`` or before)."""
        wait_s = self.config.straggler_wait_s
        if not wait_s:
            return False
        now, done = time.monotonic(), set(complete)
        for task_id, group in self._groups.items():
            if task_id in done or now - self._first_seen[task_id] > wait_s:
                continue
            if min(d.message.rollout.min_policy_version for d in group.values()) <= version - self.config.max_lag:
                if task_id not in self._waited:
                    self._waited.add(task_id)
                    self.counters["straggler_groups_waited"] += 1
                return True
        return False

    # ---------------------------------------------------------------- ledger
    @property
    def trained_log(self) -> list[str]:
        return list(self.trained_ids)

    def mark_trained(self, ids: list[str]) -> None:
        self.trained_ids.update(ids)

    def mark_settled(self, ids: list[str]) -> None:
        self.settled_ids.update(ids)

    # --------------------------------------------------------------- offsets
    def safe_offsets(self) -> dict[TopicPartition, int]:
        """Per partition touched since the last call: up to the oldest record still pending in a group."""
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

    def advance(self) -> dict[TopicPartition, int]:
        """Move ``position`` on by ``safe_offsets()``; the whole position, to commit."""
        self.position.update(self.safe_offsets())
        return dict(self.position)

    # ----------------------------------------------------------- checkpoints
    def state(self) -> dict:
        """The ledger and the position, as a checkpoint holds them."""
        return {
            "trained_log": list(self.trained_ids),
            "settled_ids": list(self.settled_ids),
            "position": {(tp.topic, tp.partition): o for tp, o in self.position.items()},
        }

    def load(self, state: dict) -> None:
        """Continue from a checkpoint's ledger and position."""
        self.trained_ids = RecentIds(state["trained_log"])
        self.settled_ids = RecentIds(state.get("settled_ids", ()))
        self.position = {TopicPartition(t, p): o for (t, p), o in state["position"].items()}
