"""Tasks a rollout worker will not run, and what it publishes instead.

One task must never stop a worker: a task the worker refuses (sampling settings or lengths the
engine cannot serve, a group larger than the run allows, an attempt that several workers already
claimed and never finished) is dead-lettered with the reason, and its ``group_size`` samples are
published as ``error`` rollouts without tokens. The reward bridge scores those ``infra`` and the
learner counts them consumed without training on them, so admission's accounting closes (the
samples were counted against the pipeline's bound when the attempt was claimed) and the lake keeps
a row saying why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from conveyor.contracts import Rollout, SamplingParams, Task, Timings, VersionSegment, rollout_id


class TaskRefused(ValueError):
    """This task cannot be served by this worker's engine; the worker carries on."""


@dataclass(frozen=True)
class TaskLimits:
    max_group_size: int = 1024
    max_context_tokens: int = 4096
    max_prompt_chars: int = 1_000_000
    max_claims: int = 5
    """An attempt claimed this many times was held by as many workers that died or lost it before
    publishing; the next worker refuses it rather than be the next to die on it."""
    top_p: bool = True
    """Whether the engine samples with nucleus truncation (the reference engine does not)."""
    vision: bool = False
    """Whether the engine's model reads images (a vision-language model with its image processor)."""


def refusal(task: Task, sampling: SamplingParams, claims: int, limits: TaskLimits) -> str | None:
    """Why ``task`` must not be run (checks that need no tokenizer), or None."""
    if claims >= limits.max_claims:
        return f"claimed {claims} times by workers that did not finish it (rollout.max_task_claims {limits.max_claims})"
    if task.group_size > limits.max_group_size:
        return f"group_size {task.group_size} is above this run's limit {limits.max_group_size}"
    if sampling.max_tokens >= limits.max_context_tokens:
        return (
            f"sampling.max_tokens {sampling.max_tokens} does not fit the engine's context of {limits.max_context_tokens} tokens"
        )
    if not limits.top_p and sampling.top_p != 1.0:
        return f"sampling.top_p {sampling.top_p}: this engine samples the whole distribution (top_p must be 1.0)"
    if not 0.0 < sampling.top_p <= 1.0 or not 0.0 <= sampling.temperature <= 100.0:
        return f"sampling out of range: temperature {sampling.temperature}, top_p {sampling.top_p}"
    if task.images and not limits.vision:
        return f"task has {len(task.images)} image(s) and this worker's model reads no images (not a vision-language model)"
    chars = len(task.prompt or "") + sum(len(m.text) for m in task.messages or ())
    if chars > limits.max_prompt_chars:
        return f"prompt of {chars} characters is above this run's limit {limits.max_prompt_chars}"
    return None


def prompt_refusal(prompt_tokens: int, sampling: SamplingParams, limits: TaskLimits) -> str | None:
    if prompt_tokens + sampling.max_tokens > limits.max_context_tokens:
        return (
            f"prompt of {prompt_tokens} tokens + sampling.max_tokens {sampling.max_tokens} exceeds the engine's "
            f"context of {limits.max_context_tokens} tokens"
        )
    return None


def error_rollouts(task: Task, reason: str, version: int) -> list[Rollout]:
    """``version``: the policy the worker served when it refused (the lake files rows by it)."""
    now = time.time()
    return [
        Rollout(
            rollout_id=rollout_id(task.task_id, i, task.attempt),
            task_id=task.task_id,
            run_id=task.run_id,
            sample_index=i,
            attempt=task.attempt,
            group_size=task.group_size,
            prompt_token_ids=[],
            completion_token_ids=[],
            behaviour_logprobs=[],
            loss_mask=[],
            version_segments=[VersionSegment(start=0, end=0, policy_version=max(version, 0))],
            finish_reason="error",
            timings=Timings(generation_started_at=now, generation_finished_at=now),
            task=None,  # the task itself is in the dead letter: a refused one may be huge
            error=reason[:1000],
        )
        for i in range(task.group_size)
    ]
