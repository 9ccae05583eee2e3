"""The producer feeds complete scored groups to its curriculum."""

from __future__ import annotations

from conveyor.contracts import Rollout, ScoredRollout, VersionSegment, rollout_id
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from producers.curriculum import Curriculum, CurriculumConfig
from producers.producer import TaskProducer
from producers.sources import suite_tasks


def scored(task, i, reward):
    r = Rollout(rollout_id=rollout_id(task.task_id, i, task.attempt), task_id=task.task_id, run_id="r", sample_index=i,
                attempt=task.attempt, group_size=task.group_size, prompt_token_ids=[1], completion_token_ids=[2],
                behaviour_logprobs=[-0.1], loss_mask=[1], version_segments=[VersionSegment(start=0, end=1, policy_version=0)],
                task=task)  # fmt: skip
    return ScoredRollout(rollout=r, reward=reward, verdict="pass" if reward else "fail")


def test_complete_groups_reach_the_curriculum():
    tasks = suite_tasks("math_numeric", "r", 2)
    cur = Curriculum(tasks, CurriculumConfig(seed=0, solved_window=1, solved_threshold=0.9))
    prod = TaskProducer(MemoryTransport(), Topics("r"), cur, learner_batch_samples=8, curriculum=cur)
    first = next(cur)
    prod._feed_curriculum([scored(first, 0, 1.0)])  # half a group: nothing recorded yet
    assert first.task_id not in cur.retired
    prod._feed_curriculum([scored(first, 1, 1.0)])
    assert first.task_id in cur.retired
