"""The learner's batching, offset and staleness rules, without training."""

from __future__ import annotations

import time

import pytest
import torch

from conveyor.config import LearnerConfig
from conveyor.contracts import Rollout, ScoredRollout, Task, VersionSegment, rollout_id
from conveyor.messaging import Delivery
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.base import Record, TopicPartition
from conveyor.transport.memory import MemoryTransport
from learner.batching import Batcher
from learner.preparation import prepare
from learner.recipe import GRPOLearner


def scored(task_id: str, i: int, group_size: int = 2, version: int = 0) -> ScoredRollout:
    return ScoredRollout(
        rollout=Rollout(
            rollout_id=rollout_id(task_id, i),
            task_id=task_id,
            run_id="r",
            sample_index=i,
            group_size=group_size,
            prompt_token_ids=[1],
            completion_token_ids=[2],
            behaviour_logprobs=[-0.1],
            loss_mask=[1],
            version_segments=[VersionSegment(start=0, end=1, policy_version=version)],
            task=Task(task_id=task_id, run_id="r", prompt="p", group_size=group_size),
        ),
        reward=float(i % 2),
        verdict="pass" if i % 2 else "fail",
    )


def delivery(s: ScoredRollout, partition: int, offset: int) -> Delivery:
    return Delivery(s, Record("scored", partition, offset, s.rollout.task_id.encode(), b"", 0))


def batcher(**kw) -> Batcher:
    return Batcher(LearnerConfig(**kw))


def learner(tmp_path, **kw) -> GRPOLearner:
    return GRPOLearner(MemoryTransport(), Topics("r"), torch.nn.Linear(2, 2), 0, LocalObjectStore(tmp_path),
                       LearnerConfig(checkpoint_every=0, **kw), run_dir=tmp_path)  # fmt: skip


def test_batches_hold_only_complete_groups():
    b = batcher(batch_groups=2)
    b.add(delivery(scored("a", 0), 0, 0))
    b.add(delivery(scored("b", 0), 0, 1))
    b.add(delivery(scored("a", 1), 0, 2))
    assert b.ready(version=0) is None  # only group a is complete
    b.add(delivery(scored("b", 1), 0, 3))
    batch = b.ready(version=0)
    assert [sorted(s.rollout.sample_index for s in g) for g in batch] == [[0, 1], [0, 1]]


def test_commit_stops_at_the_oldest_record_of_a_pending_group():
    b = batcher(batch_groups=1)
    b.add(delivery(scored("a", 0), 0, 10))
    b.add(delivery(scored("b", 0), 0, 11))  # b stays incomplete
    b.add(delivery(scored("a", 1), 0, 12))
    assert b.ready(version=0) is not None
    # a (offsets 10, 12) is done, b's member at 11 is pending: commit up to 11, never past it.
    assert b.safe_offsets() == {TopicPartition("scored", 0): 11}


def test_incomplete_groups_time_out_and_are_counted():
    b = batcher(batch_groups=1, group_timeout_s=0.001)
    b.add(delivery(scored("lost", 0, group_size=4), 1, 5))
    time.sleep(0.01)  # past the timeout
    assert b.expire() == 1  # its one sample is consumed (settled, never trained on)
    assert b.counters["groups_incomplete"] == 1
    assert b.safe_offsets() == {TopicPartition("scored", 1): 6}


def test_stale_samples_are_dropped_and_zero_variance_groups_filtered(tmp_path):
    lrn = learner(tmp_path, max_lag=1)
    lrn.version = 3
    stale = [scored("old", 0, version=1), scored("old", 1, version=1)]  # lag 2 > max_lag
    flat = [ScoredRollout(rollout=scored("flat", i, version=3).rollout, reward=1.0, verdict="pass") for i in range(2)]
    stats = lrn.train_step([stale, flat])
    assert lrn.counters["samples_stale_dropped"] == 2
    assert lrn.counters["groups_zero_variance"] == 1
    assert stats["trained_samples"] == 0
    assert stats["staleness"] == {"0": 2, "2": 2} and stats["max_staleness"] == 2


def test_stale_samples_can_be_down_weighted_instead_of_dropped():
    fresh_group = [scored("a", i, version=4) for i in range(2)]  # lag 0: weight 1
    old_group = [scored("b", i, version=1) for i in range(2)]  # lag 3 = max_lag + 2: weight 0.25
    prepared = prepare([fresh_group, old_group], 4, LearnerConfig(max_lag=1, stale_decay=0.5))
    advantages = prepared.work["advantages"]  # what the step trains with
    a_fresh, a_old = advantages[:2], advantages[2:]
    assert [abs(x) for x in a_old] == pytest.approx([0.25 * abs(x) for x in a_fresh])
    assert prepared.counts["samples_stale_downweighted"] == 2 and prepared.counts["samples_stale_dropped"] == 0
    with pytest.raises(ValueError, match="stale_decay"):
        LearnerConfig(stale_decay=1.0)


def test_batches_take_the_oldest_policy_version_first():
    b = batcher(batch_groups=1)
    for i in range(2):
        b.add(delivery(scored("new", i, version=5), 0, i))  # arrives first (its partition was read first)
    for i in range(2):
        b.add(delivery(scored("old", i, version=4), 1, i))
    assert [g[0].rollout.task_id for g in b.ready(version=0)] == ["old"]
    assert [g[0].rollout.task_id for g in b.ready(version=0)] == ["new"]


def test_a_step_waits_for_a_straggling_group_it_would_make_stale():
    b = batcher(batch_groups=1, max_lag=1, straggler_wait_s=30.0)
    b.add(delivery(scored("late", 0, group_size=2, version=2), 0, 0))  # its second sample is still being scored
    b.add(delivery(scored("new", 0, version=3), 0, 1))
    b.add(delivery(scored("new", 1, version=3), 0, 2))
    # Stepping from version 3 would take version 4, and "late" (version 2) would be 2 > max_lag versions old.
    assert b.ready(version=3) is None
    assert b.counters["straggler_groups_waited"] == 1
    b.add(delivery(scored("late", 1, group_size=2, version=2), 0, 3))
    batch = b.ready(version=3)
    assert [g[0].rollout.task_id for g in batch] == ["late"]  # the oldest first, within max_lag


def test_the_wait_for_a_straggler_is_bounded():
    b = batcher(batch_groups=1, max_lag=1, straggler_wait_s=0.0)  # 0: never wait
    b.add(delivery(scored("late", 0, group_size=2, version=2), 0, 0))
    b.add(delivery(scored("new", 0, version=3), 0, 1))
    b.add(delivery(scored("new", 1, version=3), 0, 2))
    assert [g[0].rollout.task_id for g in b.ready(version=3)] == ["new"]
    # A group that is not about to go stale holds nothing back either.
    b2 = batcher(batch_groups=1, max_lag=1, straggler_wait_s=30.0)
    b2.add(delivery(scored("recent", 0, group_size=2, version=3), 0, 0))
    b2.add(delivery(scored("new", 0, version=3), 0, 1))
    b2.add(delivery(scored("new", 1, version=3), 0, 2))
    assert b2.ready(version=3) is not None


def test_the_ledger_of_ids_is_bounded_and_survives_a_checkpoint():
    """Neither memory nor checkpoints grow with the run: the ledger keeps the latest ids (the
    offsets are the exactly-once record; the window catches re-sent copies)."""
    from conveyor.config import LearnerConfig
    from learner.batching import Batcher, RecentIds

    b = Batcher(LearnerConfig())
    b.trained_ids = RecentIds(maxlen=5)
    b.mark_trained([f"ro-{i}" for i in range(8)])
    assert b.trained_log == ["ro-3", "ro-4", "ro-5", "ro-6", "ro-7"] and "ro-2" not in b.trained_ids
    b.mark_settled(["ro-x"])
    again = Batcher(LearnerConfig())
    again.load(b.state())
    assert again.trained_log == b.trained_log and "ro-x" in again.settled_ids and "ro-7" in again.trained_ids
