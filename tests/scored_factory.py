"""Scored rollouts made up for learner tests (complete groups of tiny token sequences)."""

from __future__ import annotations

from conveyor.contracts import Rollout, ScoredRollout, Task, VersionSegment, float32_array, int32_array, rollout_id, uint8_array


def scored_group(run_id: str, g: int, group_size: int, length: int = 3) -> list[ScoredRollout]:
    """Group ``g``: ``group_size`` samples of ``length`` tokens, rewards alternating 0/1 (never zero variance)."""
    task = Task(task_id=f"task-{g}", run_id=run_id, prompt="a = [1]", group_size=group_size)
    out = []
    for i in range(group_size):
        ids = [5 + (g + i + k) % 7 for k in range(length)]
        out.append(ScoredRollout(
            rollout=Rollout(
                rollout_id=rollout_id(task.task_id, i), task_id=task.task_id, run_id=run_id, sample_index=i,
                group_size=group_size, prompt_token_ids=int32_array([3, 4, 5]), completion_token_ids=int32_array(ids),
                behaviour_logprobs=float32_array([-1.0] * length), loss_mask=uint8_array([1] * length),
                version_segments=[VersionSegment(start=0, end=length, policy_version=0)], task=task,
            ),
            reward=float(i % 2), verdict="pass" if i % 2 else "fail",
        ))  # fmt: skip
    return out
