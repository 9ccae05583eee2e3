"""Supervised fine-tuning on a user's demonstrations (``conveyor train sft --data FILE``).

Records in the layouts TRL's SFT uses:

- ``{"prompt": str, "completion": str}``: plain text;
- ``{"prompt": [messages], "completion": [messages]}``: a conversation and the assistant's reply;
- ``{"messages": [...]}``: a conversation whose last message is the assistant's reply.

Prompts are rendered as the rollout engines render them (``conveyor.hf.encode_prompt``: the
model's chat template, the assistant's turn opened), so what SFT teaches is what RL then
samples from. The reply is trained on, followed by the tokenizer's end-of-sequence token (a chat
model's end of turn), so the model learns to stop; prompt tokens are context only.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from conveyor import hf

Example = tuple[list[int], list[int]]


@dataclass(frozen=True)
class BadDemonstration:
    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def _reply(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict) and value[-1].get("role") == "assistant":
        return str(value[-1].get("content", ""))
    raise ValueError("completion: expected text or messages ending with the assistant's")


def demonstration(record: Any, tokenizer, *, max_tokens: int | None = None) -> Example:
    """One record as (prompt ids, completion ids); raises ValueError naming the field at fault."""
    if not isinstance(record, dict):
        raise ValueError(f"expected an object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or len(messages) < 2 or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages: expected a conversation of at least two messages")
        if messages[-1].get("role") != "assistant":
            raise ValueError("messages: the last message must be the assistant's (the reply to learn)")
        prompt = hf.encode_prompt(tokenizer, None, messages[:-1])
        reply = str(messages[-1].get("content", ""))
    elif "prompt" in record and "completion" in record:
        p = record["prompt"]
        if isinstance(p, list):
            prompt = hf.encode_prompt(tokenizer, None, p)
        elif isinstance(p, str):
            prompt = hf.encode_prompt(tokenizer, p)
        else:
            raise ValueError("prompt: expected text or messages")
        reply = _reply(record["completion"])
    else:
        raise ValueError("expected messages, or prompt and completion")
    if not reply.strip():
        raise ValueError("completion: empty reply")
    completion = hf.encode(tokenizer, reply) + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    if max_tokens is not None and len(prompt) + len(completion) > max_tokens:
        raise ValueError(f"{len(prompt) + len(completion)} tokens, over the limit of {max_tokens}")
    return prompt, completion


def demonstrations(
    records: Iterable[tuple[str, Any]], tokenizer, *, max_tokens: int | None = None
) -> tuple[list[Example], list[BadDemonstration]]:
    """``(where, record)`` pairs as examples; the records that cannot be used, each with why."""
    examples, bad = [], []
    for where, record in records:
        try:
            examples.append(demonstration(record, tokenizer, max_tokens=max_tokens))
        except ValueError as exc:
            bad.append(BadDemonstration(where, str(exc)))
    return examples, bad


def train_sft(
    model, examples: list[Example], pad_id: int, *, epochs: int = 1, batch_size: int = 16, lr: float = 2e-5, seed: int = 0,
    on_step=None,
) -> dict:  # fmt: skip
    """Epochs of shuffled mini-batches, negative log-likelihood of the completion tokens.
    ``on_step(1, status=...)`` after each step (the CLI's progress)."""
    from learner.sft import sft_step

    if not examples:
        raise ValueError("no demonstrations to train on")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    losses = []
    for _ in range(epochs):
        order = list(examples)
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            batch = order[i : i + batch_size]
            losses.append(sft_step(model, opt, [p for p, _ in batch], [c for _, c in batch], pad_id))
            if on_step is not None:
                on_step(1, status=f"loss {losses[-1]:.3f}")
    return {"examples": len(examples), "steps": len(losses), "loss_first": losses[0], "loss_last": losses[-1]}
