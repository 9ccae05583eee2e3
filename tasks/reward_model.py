"""The ``reward_model`` verifier: a Hugging Face sequence-classification model scores each
(prompt, completion), as RLHF's reward models do.

``verifier.data``: ``model`` (a local directory or a Hub id through the local cache, required),
and optionally ``mean`` and ``std`` (the reward is ``(score - mean) / std``: the model's scale
made comparable across models), ``pass_at`` (a reward at or above it counts as a pass; 0.0) and
``max_length`` (tokens per scored text; 2048).

A chat prompt and its completion are scored as one conversation through the reward model's own
chat template (the completion as the assistant's turn); a text prompt is scored as prompt +
completion. Each process loads a model once, on its GPU when it has one, and scores a batch of
samples of one model in one forward pass. It runs in the reward worker's process: route its
tasks to a queue of their own (``reward.queues``) so reward-model workers, which want a GPU,
scale apart from sandbox workers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

_models: dict[str, tuple[object, object]] = {}
_lock = threading.Lock()


def _load(name: str):
    with _lock:
        if name not in _models:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            from conveyor.hf import resolve_model

            path = resolve_model(name)
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(path).eval()
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            model.config.pad_token_id = tok.pad_token_id
            if torch.cuda.is_available():
                model = model.cuda()
            _models[name] = (model, tok)
        return _models[name]


def _text(tok, task, completion: str) -> str:
    if task.messages and getattr(tok, "chat_template", None):
        turns = [{"role": m.role, "content": m.text} for m in task.messages]
        return tok.apply_chat_template([*turns, {"role": "assistant", "content": completion}], tokenize=False)
    if task.messages:
        return "".join(f"{m.role}: {m.text}\n" for m in task.messages) + f"assistant: {completion}"
    return (task.prompt or "") + completion


def scores(model_name: str, tasks: Sequence, completions: Sequence[str], max_length: int = 2048) -> list[float]:
    """The reward model's raw score (its first logit) for each (task, completion)."""
    import torch

    model, tok = _load(model_name)
    texts = [_text(tok, t, c) for t, c in zip(tasks, completions)]
    batch = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_length, add_special_tokens=False)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
    return [float(x) for x in logits[:, 0].float().cpu()]
