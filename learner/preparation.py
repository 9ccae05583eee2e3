"""A batch of complete groups -> the trainer's work: staleness, filters and group-relative advantages.

- A sample's lag is the policy version it is trained at minus the oldest version that
  generated it. Samples older than ``max_lag`` versions are dropped and counted, or
  (``stale_decay`` > 0) kept with their advantage scaled by ``stale_decay ** (lag - max_lag)``
  and counted; the staleness histogram of every step is logged.
- A sample whose verdict is ``infra`` (the reward service failed, not the model) carries no
  signal: it is dropped and counted.
- A group left with fewer than two samples, or with zero reward variance, is filtered (dynamic
  sampling) and counted.
- The rest become the trainer's ``work``: token ids, behaviour log-probabilities, advantages
  (``learner/grpo.py``), loss masks, whether exactly the current weights generated each sample
  (its gap to the learner's log-probabilities is then the train/inference mismatch), each
  sample's sampling temperature (a greedy sample has no sampled distribution: 1) and, for
  tasks with pictures, each sample's image references (read from the store before the step).

``prepare`` changes nothing: it returns what it decided (``Prepared``), and the recipe applies
that to its ledger of rollout ids and its counters.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from conveyor.config import LearnerConfig
from conveyor.contracts import ScoredRollout
from learner.grpo import group_advantages


def _tensor(view: memoryview, dtype) -> torch.Tensor:
    """A packed wire array as a tensor (one copy: the record's buffer is read-only)."""
    if len(view) == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(bytearray(view), dtype=dtype)


@dataclass
class Prepared:
    """What a batch gives the trainer, and what became of each of its samples."""

    work: dict | None  # the trainer's input (``Trainer.step``); None: nothing to train on
    trained: list[str] = field(default_factory=list)  # rollout ids in ``work``, in order
    settled: list[str] = field(default_factory=list)  # consumed without training (stale, infra, filtered)
    counts: Counter[str] = field(default_factory=Counter)  # why samples and groups were dropped or down-weighted
    staleness: Counter[int] = field(default_factory=Counter)  # lag -> samples
    rewards: list[float] = field(default_factory=list)  # every sample's, kept or not
    passed: int = 0  # samples whose verdict was "pass"

    def stats(self) -> dict:
        """The batch's part of a step's metrics."""
        n = max(len(self.rewards), 1)
        mean = sum(self.rewards) / n
        return {
            "reward_mean": mean,
            "reward_std": (sum((r - mean) ** 2 for r in self.rewards) / n) ** 0.5,
            "pass_rate": self.passed / n,
            "samples": len(self.rewards),
            "trained_samples": len(self.trained),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "max_staleness": max(self.staleness) if self.staleness else 0,
        }


def prepare(batch: list[list[ScoredRollout]], version: int, config: LearnerConfig) -> Prepared:
    """The work of a step taken at policy ``version`` on ``batch`` (complete groups)."""
    out = Prepared(work=None)
    columns: dict[str, list] = {
        k: [] for k in ("prompts", "completions", "behaviour", "advantages", "masks", "fresh", "temps", "images")
    }
    for group in batch:
        out.rewards.extend(s.reward for s in group)
        out.passed += sum(s.verdict == "pass" for s in group)
        kept, weights = [], []
        for s in group:
            lag = version - s.rollout.min_policy_version
            out.staleness[lag] += 1
            weight = 1.0
            if lag > config.max_lag:
                if not config.stale_decay:
                    out.counts["samples_stale_dropped"] += 1
                    out.settled.append(s.rollout_id)
                    continue
                weight = config.stale_decay ** (lag - config.max_lag)
                out.counts["samples_stale_downweighted"] += 1
            if s.verdict == "infra":
                out.counts["samples_infra_dropped"] += 1
                out.settled.append(s.rollout_id)
                continue
            kept.append(s)
            weights.append(weight)
        if len(kept) < 2:
            out.counts["samples_group_too_small"] += len(kept)
            out.settled.extend(s.rollout_id for s in kept)
            continue
        adv = group_advantages([s.reward for s in kept], config.std_normalise)
        if adv is None:
            out.counts["groups_zero_variance"] += 1
            out.counts["samples_zero_variance"] += len(kept)
            out.settled.extend(s.rollout_id for s in kept)
            continue
        for s, a, w in zip(kept, adv, weights):
            r = s.rollout
            columns["prompts"].append(r.prompt_token_ids.tolist())
            columns["completions"].append(r.completion_token_ids.tolist())
            columns["behaviour"].append(_tensor(r.behaviour_logprobs, torch.float32))
            columns["fresh"].append(r.min_policy_version == r.max_policy_version == version)
            temp = r.task.sampling.temperature if r.task is not None and r.task.sampling is not None else 1.0
            columns["temps"].append(temp if temp > 0 else 1.0)
            columns["masks"].append(_tensor(r.loss_mask, torch.uint8).float())
            columns["advantages"].append(a * w)  # a stale sample's say in the update shrinks with its age
            columns["images"].append(r.task.images if r.task is not None else [])
            out.trained.append(r.rollout_id)
    if not any(columns["images"]):
        del columns["images"]  # a text batch: the work has no images column
    if out.trained:
        out.work = columns
    return out
