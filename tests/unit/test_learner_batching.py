"""The learner's batching and offset rules, without training."""

from __future__ import annotations

import pytest
import torch

from conveyor.contracts import Rollout, ScoredRollout, Task, VersionSegment, rollout_id
from conveyor.messaging import Delivery
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.base import Record, TopicPartition
from conveyor.transport.memory import MemoryTransport
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


def learner(tmp_path, **kw) -> GRPOLearner:
    return GRPOLearner(
        MemoryTransport(), Topics("r"), torch.nn.Linear(2, 2), 0, LocalObjectStore(tmp_path), run_dir=tmp_path, **kw
    )


def test_batches_hold_only_complete_groups(tmp_path):
    lrn = learner(tmp_path, batch_groups=2)
    lrn._add(delivery(scored("a", 0), 0, 0))
    lrn._add(delivery(scored("b", 0), 0, 1))
    lrn._add(delivery(scored("a", 1), 0, 2))
    assert lrn._ready_batch() is None  # only group a is complete
    lrn._add(delivery(scored("b", 1), 0, 3))
    batch = lrn._ready_batch()
    assert [sorted(s.rollout.sample_index for s in g) for g in batch] == [[0, 1], [0, 1]]


def test_commit_stops_at_the_oldest_record_of_a_pending_group(tmp_path):
    lrn = learner(tmp_path, batch_groups=1)
    lrn._add(delivery(scored("a", 0), 0, 10))
    lrn._add(delivery(scored("b", 0), 0, 11))  # b stays incomplete
    lrn._add(delivery(scored("a", 1), 0, 12))
    assert lrn._ready_batch() is not None
    # a (offsets 10, 12) is done, b's member at 11 is pending: commit up to 11, never past it.
    assert lrn._safe_offsets() == {TopicPartition("scored", 0): 11}


def test_incomplete_groups_time_out_and_are_counted(tmp_path):
    lrn = learner(tmp_path, batch_groups=1, group_timeout_s=0.0)
    lrn._add(delivery(scored("lost", 0, group_size=4), 1, 5))
    lrn._expire()
    assert lrn.counters["groups_incomplete"] == 1
    assert lrn._safe_offsets() == {TopicPartition("scored", 1): 6}


def test_stale_samples_are_dropped_and_zero_variance_groups_filtered(tmp_path):
    lrn = learner(tmp_path, max_lag=1)
    lrn.version = 3
    stale = [scored("old", 0, version=1), scored("old", 1, version=1)]  # lag 2 > max_lag
    flat = [ScoredRollout(rollout=scored("flat", i, version=3).rollout, reward=1.0, verdict="pass") for i in range(2)]
    stats = lrn._train_step([stale, flat])
    assert lrn.counters["samples_stale_dropped"] == 2
    assert lrn.counters["groups_zero_variance"] == 1
    assert stats["trained_samples"] == 0
    assert stats["staleness"] == {"0": 2, "2": 2} and stats["max_staleness"] == 2


def test_stale_samples_can_be_down_weighted_instead_of_dropped(tmp_path):
    lrn = learner(tmp_path, max_lag=1, stale_decay=0.5)
    lrn.version = 4
    seen = {}

    class Captured(Exception):
        pass

    def capture(prompts, completions, behaviour, advantages, masks, fresh=None, temps=None, prox_cache=None):
        seen["advantages"] = advantages
        raise Captured  # the step itself is not under test

    lrn._accumulate = capture
    fresh_group = [scored("a", i, version=4) for i in range(2)]  # lag 0: weight 1
    old_group = [scored("b", i, version=1) for i in range(2)]  # lag 3 = max_lag + 2: weight 0.25
    with pytest.raises(Captured):
        lrn._train_step([fresh_group, old_group])
    a_fresh, a_old = seen["advantages"][:2], seen["advantages"][2:]
    assert [abs(x) for x in a_old] == pytest.approx([0.25 * abs(x) for x in a_fresh])
    assert lrn.counters["samples_stale_downweighted"] == 2 and lrn.counters["samples_stale_dropped"] == 0
    with pytest.raises(ValueError, match="stale_decay"):
        learner(tmp_path, stale_decay=1.0)


def test_batches_take_the_oldest_policy_version_first(tmp_path):
    lrn = learner(tmp_path, batch_groups=1)
    for i in range(2):
        lrn._add(delivery(scored("new", i, version=5), 0, i))  # arrives first (its partition was read first)
    for i in range(2):
        lrn._add(delivery(scored("old", i, version=4), 1, i))
    assert [g[0].rollout.task_id for g in lrn._ready_batch()] == ["old"]
    assert [g[0].rollout.task_id for g in lrn._ready_batch()] == ["new"]


def test_a_step_waits_for_a_straggling_group_it_would_make_stale(tmp_path):
    lrn = learner(tmp_path, batch_groups=1, max_lag=1, straggler_wait_s=30.0)
    lrn.version = 3
    lrn._add(delivery(scored("late", 0, group_size=2, version=2), 0, 0))  # its second sample is still being scored
    lrn._add(delivery(scored("new", 0, version=3), 0, 1))
    lrn._add(delivery(scored("new", 1, version=3), 0, 2))
    # Stepping now would take version 4, and "late" (version 2) would be 2 > max_lag versions old.
    assert lrn._ready_batch() is None
    assert lrn.counters["straggler_groups_waited"] == 1
    lrn._add(delivery(scored("late", 1, group_size=2, version=2), 0, 3))
    batch = lrn._ready_batch()
    assert [g[0].rollout.task_id for g in batch] == ["late"]  # the oldest first, within max_lag


def test_the_wait_for_a_straggler_is_bounded(tmp_path):
    lrn = learner(tmp_path, batch_groups=1, max_lag=1, straggler_wait_s=0.0)  # 0: never wait
    lrn.version = 3
    lrn._add(delivery(scored("late", 0, group_size=2, version=2), 0, 0))
    lrn._add(delivery(scored("new", 0, version=3), 0, 1))
    lrn._add(delivery(scored("new", 1, version=3), 0, 2))
    assert [g[0].rollout.task_id for g in lrn._ready_batch()] == ["new"]
    # A group that is not about to go stale holds nothing back either.
    lrn2 = learner(tmp_path, batch_groups=1, max_lag=1, straggler_wait_s=30.0)
    lrn2.version = 3
    lrn2._add(delivery(scored("recent", 0, group_size=2, version=3), 0, 0))
    lrn2._add(delivery(scored("new", 0, version=3), 0, 1))
    lrn2._add(delivery(scored("new", 1, version=3), 0, 2))
    assert lrn2._ready_batch() is not None
