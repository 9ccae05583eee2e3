"""Curriculum: epochs, seeds, priorities, re-queueing, retiring, and the hard-task floor."""

from __future__ import annotations

from collections import Counter

import pytest

from conveyor.contracts import Task, VerifierSpec, rollout_id
from producers.curriculum import Curriculum, CurriculumConfig

GROUP = 4


def make_task(task_id: str, priority: int = 0, group_size: int = GROUP) -> Task:
    return Task(
        task_id=task_id,
        run_id="r",
        prompt=f"solve {task_id}",
        verifier=VerifierSpec(kind="math", data={"answer": "1"}),
        group_size=group_size,
        priority=priority,
    )


def suite(easy: int = 30, mixed: int = 20, hard: int = 5) -> list[Task]:
    return (
        [make_task(f"easy-{i}") for i in range(easy)]
        + [make_task(f"mixed-{i}") for i in range(mixed)]
        + [make_task(f"hard-{i}") for i in range(hard)]
    )


def policy(task: Task) -> list[float]:
    """Solves easy tasks, never hard ones, half the samples of mixed ones."""
    kind = task.task_id.split("-")[0]
    if kind == "easy":
        return [1.0] * task.group_size
    if kind == "hard":
        return [0.0] * task.group_size
    return [float(i % 2) for i in range(task.group_size)]


def simulate(cur: Curriculum, steps: int) -> list[Task]:
    """Schedule ``steps`` tasks, scoring each group at once."""
    out = []
    for task in cur:
        out.append(task)
        cur.record(task.task_id, policy(task))
        if len(out) == steps:
            break
    return out


def is_hard(task: Task) -> bool:
    return task.task_id.startswith("hard-")


# --------------------------------------------------------------------------
# the hard-task floor


def test_hard_tasks_keep_their_minimum_share():
    floor, window = 0.2, 100
    cur = Curriculum(suite(), CurriculumConfig(seed=3, min_hard_fraction=floor))
    stream = simulate(cur, 2000)
    assert len(stream) == 2000
    # From the moment the first hard task has failed, every window of the stream
    # holds at least the floor's share of hard tasks (one less for rounding).
    start = next(i for i, t in enumerate(stream) if is_hard(t)) + 1
    hard = [is_hard(t) for t in stream[start:]]
    for i in range(0, len(hard) - window + 1):
        assert sum(hard[i : i + window]) >= floor * window - 1, f"window at {start + i}"
    assert sum(hard) / len(hard) >= floor - 0.01
    # And every hard task keeps being scheduled, not just one of them.
    late = Counter(t.task_id for t in stream[1000:] if is_hard(t))
    assert set(late) == {f"hard-{i}" for i in range(5)}
    assert min(late.values()) >= 0.8 * max(late.values())
    assert cur.hard == set(late)


def test_without_the_floor_hard_tasks_get_less():
    """The control: the same stream with no floor gives hard tasks a smaller share."""
    cur = Curriculum(suite(), CurriculumConfig(seed=3, min_hard_fraction=0.0))
    stream = simulate(cur, 2000)
    share = sum(map(is_hard, stream[500:])) / len(stream[500:])
    assert 0 < share < 0.15


def test_floor_of_one_schedules_only_hard_tasks_once_known():
    cur = Curriculum(suite(easy=5, mixed=5, hard=2), CurriculumConfig(seed=0, min_hard_fraction=1.0))
    stream = simulate(cur, 200)
    start = next(i for i, t in enumerate(stream) if is_hard(t)) + 1
    assert all(is_hard(t) for t in stream[start:])


# --------------------------------------------------------------------------
# retiring and re-queueing


def test_solved_tasks_are_retired():
    cfg = CurriculumConfig(seed=1, solved_window=2, solved_threshold=0.9)
    cur = Curriculum(suite(), cfg)
    stream = simulate(cur, 2000)
    easy = {f"easy-{i}" for i in range(30)}
    assert easy <= cur.retired
    assert not (cur.retired - easy)  # nothing else is solved
    counts = Counter(t.task_id for t in stream)
    # Each easy task is scheduled exactly until it has a full window of passes.
    assert all(counts[tid] == cfg.solved_window for tid in easy)
    last_easy = max(i for i, t in enumerate(stream) if t.task_id in easy)
    assert last_easy < 400  # within the first two epochs


def test_retirement_needs_the_pass_rate_over_the_last_k_attempts():
    cur = Curriculum([make_task("a")], CurriculumConfig(solved_window=3, solved_threshold=0.75))
    assert cur.record("a", [1, 1, 1, 1]) == "kept"  # one attempt is not a window
    assert cur.record("a", [1, 1, 0, 0]) == "requeued"
    assert cur.record("a", [1, 1, 1, 1]) == "retired"  # 10 / 12 passes over the last 3
    assert cur.record("a", [0, 0, 0, 0]) == "ignored"
    cur = Curriculum([make_task("b")], CurriculumConfig(solved_window=2, solved_threshold=0.75))
    assert cur.record("b", [1, 1, 1, 1]) == "kept"
    assert cur.record("b", [1, 0, 0, 0]) == "requeued"  # 5 / 8 < 0.75
    assert cur.record("b", [1, 1, 1, 1]) == "kept"  # window [1/4, 4/4]: 5 / 8 < 0.75
    assert cur.record("b", [1, 1, 1, 1]) == "retired"  # the window slid past the bad group


def test_mixed_tasks_are_requeued_with_a_new_attempt():
    tasks = [make_task(f"t{i}") for i in range(10)]
    cur = Curriculum(tasks, CurriculumConfig(seed=0))
    first = next(cur)
    assert first.attempt == 0
    assert cur.record(first.task_id, [1.0, 0.0, 1.0, 0.0]) == "requeued"
    again = next(cur)
    assert again.task_id == first.task_id and again.attempt == 1
    # A group that fails throughout is not re-queued: it is hard.
    other = next(cur)
    assert cur.record(other.task_id, [0.0] * 4) == "hard"
    assert other.task_id in cur.hard
    assert next(cur).task_id != other.task_id or cur.config.min_hard_fraction >= 1


def test_mixed_tasks_get_extra_attempts_but_not_the_whole_stream():
    cur = Curriculum(suite(easy=0, mixed=10, hard=0) + [make_task("easy-x")], CurriculumConfig(seed=2))
    stream = simulate(cur, 400)
    counts = Counter(t.task_id for t in stream)
    # Every task is reached, and re-queued tasks take about half of the stream.
    assert "easy-x" in counts
    assert 0.4 <= cur.scheduled_requeued / cur.scheduled <= 0.55


def test_attempts_keep_rollout_ids_unique():
    cur = Curriculum(suite(), CurriculumConfig(seed=5, min_hard_fraction=0.3))
    stream = simulate(cur, 1000)
    seen: dict[str, list[int]] = {}
    for t in stream:
        seen.setdefault(t.task_id, []).append(t.attempt)
    for attempts in seen.values():
        assert attempts == list(range(len(attempts)))
    ids = [rollout_id(t.task_id, i, t.attempt) for t in stream for i in range(t.group_size)]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------------------
# order


def order(cur: Curriculum, steps: int) -> list[tuple[str, int]]:
    return [(t.task_id, t.attempt) for t in simulate(cur, steps)]


def test_same_seed_same_order():
    a = order(Curriculum(suite(), CurriculumConfig(seed=11)), 500)
    b = order(Curriculum(suite(), CurriculumConfig(seed=11)), 500)
    c = order(Curriculum(suite(), CurriculumConfig(seed=12)), 500)
    assert a == b
    assert a != c


def test_epochs_without_feedback():
    tasks = [make_task(f"t{i}") for i in range(20)]
    cur = Curriculum(tasks, CurriculumConfig(epochs=2, seed=4))
    stream = list(cur)
    assert len(stream) == 40
    first, second = stream[:20], stream[20:]
    assert {t.task_id for t in first} == {t.task_id for t in second} == {t.task_id for t in tasks}
    assert [t.task_id for t in first] != [t.task_id for t in tasks]  # shuffled
    assert [t.task_id for t in first] != [t.task_id for t in second]  # reshuffled per epoch
    assert all(t.attempt == 0 for t in first) and all(t.attempt == 1 for t in second)
    assert cur.epoch == 2
    assert next(cur, None) is None  # an ended stream stays ended
    unshuffled = Curriculum(tasks, CurriculumConfig(epochs=1, shuffle=False))
    assert [t.task_id for t in unshuffled] == [t.task_id for t in tasks]


def test_stream_ends_when_everything_is_retired():
    cur = Curriculum(suite(easy=10, mixed=0, hard=0), CurriculumConfig(seed=0, solved_window=1))
    stream = simulate(cur, 1000)
    assert len(stream) == 10 and len(cur.retired) == 10


def test_priorities_come_first_within_an_epoch():
    tasks = [make_task(f"low{i}") for i in range(10)] + [make_task(f"high{i}", priority=5) for i in range(3)]
    cur = Curriculum(tasks, CurriculumConfig(epochs=1, seed=9))
    ids = [t.task_id for t in cur]
    assert set(ids[:3]) == {"high0", "high1", "high2"}
    flat = Curriculum(tasks, CurriculumConfig(epochs=1, seed=9, use_priority=False))
    assert set([t.task_id for t in flat][:3]) != {"high0", "high1", "high2"}


def test_group_size_override_and_unknown_ids():
    cur = Curriculum([make_task("a", group_size=2)], CurriculumConfig(group_size=16, epochs=1))
    assert next(cur).group_size == 16
    assert cur.record("zzz", [1.0]) == "ignored"
    with pytest.raises(ValueError, match="empty group"):
        cur.record("a", [])


def test_bad_input():
    with pytest.raises(ValueError, match="duplicate task id"):
        Curriculum([make_task("a"), make_task("a")])
    with pytest.raises(ValueError, match="min_hard_fraction"):
        CurriculumConfig(min_hard_fraction=1.5)
    with pytest.raises(ValueError, match="epochs"):
        CurriculumConfig(epochs=0)
