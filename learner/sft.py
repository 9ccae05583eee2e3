"""Supervised warm-up (and the SFT loss used on replayed data).

``sft_step`` minimises the negative log-likelihood of completion tokens only
(prompt tokens are context, not targets), averaged per token.
"""

from __future__ import annotations

import torch

from learner.grpo import completion_logprobs


def sft_step(model, optimizer, prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> float:
    model.train()
    logps = completion_logprobs(model, prompts, completions, pad_id)
    loss = -torch.cat(logps).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())
