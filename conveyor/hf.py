"""Two Hugging Face model helpers the rollout engine and the learner share.

Both prefill each distinct prompt once with a KV cache and run the samples'
tokens on it (``rollout_workers/reference_engine.py`` to sample,
``learner/grpo.py`` to train): the prompts are left-padded into one batch so
every row's last position is its prompt's last token.
"""

from __future__ import annotations


def cache_keyword(model) -> str:
    """The keyword a causal LM's ``forward`` takes its KV cache by (transformers 5 renamed
    ``past_key_values`` to ``cache``); the output carries it under the same name."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def left_padded(prompts, pad_id: int):
    """``(ids, mask, positions)`` for ``prompts`` left-padded to the longest: position ids count
    each row's real tokens from 0 (padding sits at position 0, masked out)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)
