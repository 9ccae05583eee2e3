"""Group-relative advantages and the clipped policy-gradient objective.

- Advantages: ``r - mean(group)``, optionally divided by the group's std.
  Groups with zero reward variance carry no signal and are dropped
  (dynamic sampling); the caller counts them.
- Objective: PPO-clip against the *behaviour* logprobs carried in each
  rollout (the policy that actually sampled), with asymmetric clipping
  (clip-higher: ``eps_high >= eps_low``) and a truncated importance weight
  cap for stale samples; token-level aggregation (every trained token
  weighs the same) or sequence-level (every sequence weighs the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    max_importance_weight: float = 5.0
    std_normalise: bool = True
    aggregation: str = "token"  # "token" | "sequence"


def group_advantages(rewards: list[float], std_normalise: bool = True, eps: float = 1e-6) -> list[float] | None:
    """Advantages of one group, or None if the group has no reward variance."""
    t = torch.tensor(rewards, dtype=torch.float64)
    centred = t - t.mean()
    std = t.std(unbiased=False)
    if float(std) < eps:
        return None
    if std_normalise:
        centred = centred / (std + eps)
    return centred.tolist()


def completion_logprobs(model, prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> list[torch.Tensor]:
    """log p(completion token | prefix) under ``model``, one tensor per sequence."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        out.append(logp[i, len(p) - 1 : len(p) - 1 + len(c)])
    return out


def clipped_pg_loss(
    new_logprobs: list[torch.Tensor],
    behaviour_logprobs: list[torch.Tensor],
    advantages: list[float],
    loss_masks: list[torch.Tensor],
    cfg: LossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO-clip objective (to minimise) and its statistics."""
    per_seq = []
    total_tokens = 0
    ratios = []
    clipped = 0
    for new, old, adv, mask in zip(new_logprobs, behaviour_logprobs, advantages, loss_masks):
        ratio = torch.exp(new - old)
        ratios.append(ratio.detach())
        weight = ratio.clamp(max=cfg.max_importance_weight)
        unclipped = weight * adv
        clip = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
        tok_loss = -torch.minimum(unclipped, clip) * mask
        clipped += int(((unclipped > clip) & (mask > 0)).sum())
        per_seq.append(tok_loss)
        total_tokens += int(mask.sum())
    if cfg.aggregation == "token":
        loss = torch.cat(per_seq).sum() / max(total_tokens, 1)
    else:
        loss = torch.stack([s.sum() / max(int(m.sum()), 1) for s, m in zip(per_seq, loss_masks)]).mean()
    all_ratios = torch.cat(ratios) if ratios else torch.zeros(1)
    stats = {
        "importance_mean": float(all_ratios.mean()),
        "importance_max": float(all_ratios.max()),
        "clip_fraction": clipped / max(total_tokens, 1),
        "tokens": float(total_tokens),
    }
    return loss, stats
