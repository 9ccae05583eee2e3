"""A sampling policy over a task list: epochs, shuffling, priorities, curriculum.

The producer iterates a :class:`Curriculum` for the tasks to publish and calls
:meth:`Curriculum.record` with the rewards of each scored group. From those:

- a task with **mixed** results (some samples of one group pass, some fail:
  the groups that carry a learning signal) is **re-queued**, i.e. scheduled
  again soon, ahead of the rest of the epoch (a group of one is never mixed);
- a **solved** task (pass rate at least ``solved_threshold`` over its last
  ``solved_window`` recorded attempts) is **retired**: never scheduled again;
- a **hard** task (attempted, and no sample has passed yet) keeps being
  scheduled at no less than ``min_hard_fraction`` of the stream while hard
  tasks exist, so the problems the policy cannot solve yet are not starved
  when the learner drops their zero-variance groups.

Order of choice for each task scheduled:

1. a hard task, when the hard quota is owed (round-robin over the hard tasks);
2. a re-queued task, while re-queued tasks are at most ``max_requeue_fraction``
   of the stream (so one mixed task cannot monopolise it);
3. the next task of the current epoch (shuffled with ``seed``; higher
   ``Task.priority`` first); a new epoch starts when one ends, over the tasks
   not retired, until ``epochs`` are done (``None``: no limit);
4. a re-queued task beyond that share, when nothing else is left.

The stream ends when all of these are empty: every epoch done and nothing
re-queued (or every task retired). An ended iterator stays ended.

Every time a task is scheduled again its ``attempt`` goes up by one, so its
rollout ids (derived from task id, sample index and attempt) stay unique.

Usage::

    cur = Curriculum(tasks, CurriculumConfig(seed=1, min_hard_fraction=0.2))
    producer = TaskProducer(transport, topics, iter(cur), ...)
    ...
    cur.record(task_id, [s.reward for s in group])
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from conveyor.contracts import Task

Outcome = Literal["retired", "requeued", "hard", "kept", "ignored"]
_EPS = 1e-9


@dataclass(frozen=True)
class CurriculumConfig:
    epochs: int | None = None
    """Passes over the task list; None: until every task is retired (or forever)."""
    seed: int = 0
    shuffle: bool = True
    group_size: int | None = None
    """Overrides every task's group size; None: each task's own."""
    use_priority: bool = True
    """Higher ``Task.priority`` first within an epoch and among re-queued tasks."""
    pass_reward: float = 1.0
    """A sample passes when its reward is at least this."""
    solved_threshold: float = 0.9
    solved_window: int = 2
    """Retire a task when its pass rate over its last ``solved_window`` recorded attempts
    is at least ``solved_threshold`` (and it has that many attempts)."""
    requeue_mixed: bool = True
    max_requeue_fraction: float = 0.5
    """Re-queued tasks get at most this share of the stream while epoch tasks are left."""
    min_hard_fraction: float = 0.1
    """While hard tasks exist, at least this share of the stream is hard tasks."""

    def __post_init__(self) -> None:
        if self.epochs is not None and self.epochs < 1:
            raise ValueError("epochs must be >= 1 (or None)")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError("group_size must be >= 1")
        if self.solved_window < 1:
            raise ValueError("solved_window must be >= 1")
        for name in ("solved_threshold", "max_requeue_fraction", "min_hard_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")


@dataclass
class _TaskState:
    task: Task
    scheduled: int = 0  # times handed out
    recorded: int = 0  # groups recorded
    passes: int = 0  # passing samples, all time
    history: deque[tuple[int, int]] = field(default_factory=deque)  # (passes, samples) per recent attempt
    retired: bool = False
    requeued: bool = False  # waiting in the re-queue


class Curriculum(Iterator[Task]):
    """Iterator of tasks to publish; feed results back with :meth:`record`."""

    def __init__(self, tasks: Iterable[Task], config: CurriculumConfig | None = None) -> None:
        self.config = config or CurriculumConfig()
        self._states: dict[str, _TaskState] = {}
        for task in tasks:
            if task.task_id in self._states:
                raise ValueError(f"duplicate task id {task.task_id!r}")
            self._states[task.task_id] = _TaskState(task, history=deque(maxlen=self.config.solved_window))
        self._rng = random.Random(self.config.seed)
        self._epoch = 0
        self._epoch_queue: deque[str] = deque()
        self._requeue: list[tuple[int, int, str]] = []  # heap of (-priority, seq, task id)
        self._requeue_seq = 0
        self._hard: set[str] = set()
        self._hard_rotation: deque[str] = deque()  # round-robin order; stale entries skipped
        self._hard_credit = 0.0
        self._finished = False
        self.scheduled = 0
        self.scheduled_hard = 0
        self.scheduled_requeued = 0

    # ---------------------------------------------------------------- stream

    def __iter__(self) -> Curriculum:
        return self

    def __next__(self) -> Task:
        if self._finished:
            raise StopIteration
        cfg = self.config
        if self._hard:
            self._hard_credit += cfg.min_hard_fraction
        else:
            self._hard_credit = 0.0
        task_id = None
        if self._hard and self._hard_credit >= 1.0 - _EPS:
            task_id = self._pop_hard()
        if task_id is None and self._requeue and self.scheduled_requeued < cfg.max_requeue_fraction * (self.scheduled + 1):
            task_id = self._pop_requeue()
        if task_id is None:
            task_id = self._pop_epoch()
        if task_id is None:
            task_id = self._pop_requeue()
        if task_id is None:
            self._finished = True
            raise StopIteration
        return self._schedule(task_id)

    def _schedule(self, task_id: str) -> Task:
        st = self._states[task_id]
        base = st.task
        task = msgspec.structs.replace(
            base, attempt=base.attempt + st.scheduled, group_size=self.config.group_size or base.group_size
        )
        st.scheduled += 1
        self.scheduled += 1
        if task_id in self._hard:
            self.scheduled_hard += 1
            self._hard_credit = max(0.0, self._hard_credit - 1.0)
        return task

    def _pop_hard(self) -> str | None:
        for _ in range(len(self._hard_rotation)):
            task_id = self._hard_rotation.popleft()
            if task_id in self._hard:
                self._hard_rotation.append(task_id)
                return task_id
        return None

    def _pop_requeue(self) -> str | None:
        while self._requeue:
            _, _, task_id = heapq.heappop(self._requeue)
            st = self._states[task_id]
            st.requeued = False
            if not st.retired:
                self.scheduled_requeued += 1
                return task_id
        return None

    def _pop_epoch(self) -> str | None:
        while True:
            while self._epoch_queue:
                task_id = self._epoch_queue.popleft()
                if not self._states[task_id].retired:
                    return task_id
            if not self._start_epoch():
                return None

    def _start_epoch(self) -> bool:
        if self.config.epochs is not None and self._epoch >= self.config.epochs:
            return False
        active = [tid for tid, st in self._states.items() if not st.retired]
        if not active:
            return False
        if self.config.shuffle:
            self._rng.shuffle(active)
        if self.config.use_priority:
            active.sort(key=lambda tid: -self._states[tid].task.priority)  # stable: shuffle order within a priority
        self._epoch += 1
        self._epoch_queue.extend(active)
        return True

    # ---------------------------------------------------------------- feedback

    def record(self, task_id: str, rewards: Sequence[float]) -> Outcome:
        """Record one scored group of ``task_id``; returns what became of the task."""
        st = self._states.get(task_id)
        if st is None or st.retired:
            return "ignored"
        rewards = list(rewards)
        if not rewards:
            raise ValueError(f"record({task_id!r}): empty group")
        cfg = self.config
        passes = sum(1 for r in rewards if r >= cfg.pass_reward)
        st.recorded += 1
        st.passes += passes
        st.history.append((passes, len(rewards)))
        if st.passes:
            self._hard.discard(task_id)
        if st.recorded >= cfg.solved_window:
            rate = sum(p for p, _ in st.history) / sum(n for _, n in st.history)
            if rate >= cfg.solved_threshold - _EPS:
                st.retired = True
                return "retired"
        if 0 < passes < len(rewards) and cfg.requeue_mixed:
            if not st.requeued:
                st.requeued = True
                priority = st.task.priority if cfg.use_priority else 0
                heapq.heappush(self._requeue, (-priority, self._requeue_seq, task_id))
                self._requeue_seq += 1
            return "requeued"
        if st.passes == 0:
            if task_id not in self._hard:
                self._hard.add(task_id)
                self._hard_rotation.append(task_id)
            return "hard"
        return "kept"

    # ---------------------------------------------------------------- views

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def retired(self) -> set[str]:
        return {tid for tid, st in self._states.items() if st.retired}

    @property
    def hard(self) -> set[str]:
        return set(self._hard)

    def stats(self) -> dict[str, float]:
        return {
            "tasks": len(self._states),
            "retired": sum(st.retired for st in self._states.values()),
            "hard": len(self._hard),
            "requeued_waiting": sum(st.requeued for st in self._states.values()),
            "epoch": self._epoch,
            "scheduled": self.scheduled,
            "scheduled_hard": self.scheduled_hard,
            "scheduled_requeued": self.scheduled_requeued,
            "hard_fraction": self.scheduled_hard / self.scheduled if self.scheduled else 0.0,
        }
