"""Reference engine: batched sampling with a KV cache in plain PyTorch/transformers.

For machines without vLLM, and as the correctness oracle for the vLLM
backend. Prompts are left-padded into one batch, each prompt repeated ``n``
times; every step samples from ``softmax(logits / temperature)`` and records
the log-probability of the sampled token *under that same distribution*, so
the learner's importance ratios compare like with like.

Weights swap between batches (``load_state_dict``); the version that
produced a batch is recorded with it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    policy_version: int


class ReferenceEngine:
    def __init__(self, model_dir: str | Path, *, seed: int = 0, threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self._lock = threading.Lock()
        # transformers 5 renamed `past_key_values` to `cache` (input and output).
        import inspect

        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def load_state_dict(self, state: dict, version: int) -> None:
        """Swap to ``state`` (a full or HF-style state dict, tied weights stored once)."""
        with self._lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
            if unexpected or set(missing) - tied:
                raise ValueError(f"weights do not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
            self.version = version

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        stop_token_ids: set[int] | None = None,
        greedy: bool = False,
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt, grouped per prompt."""
        import torch

        stop = set(stop_token_ids or ()) | {self.tokenizer.eos_token_id}
        rows = [p for p in prompts for _ in range(n)]
        if not rows:
            return []
        pad = self.tokenizer.pad_token_id
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        with self._lock, torch.no_grad():
            version = self.version
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            cache = getattr(out, self._cache_kw)
            logits = out.logits[:, -1, :]
            next_pos = positions[:, -1:] + 1
            tokens: list[list[int]] = [[] for _ in rows]
            logps: list[list[float]] = [[] for _ in rows]
            done = torch.zeros(len(rows), dtype=torch.bool)
            stopped = torch.zeros(len(rows), dtype=torch.bool)
            for _ in range(max_new_tokens):
                logprobs = torch.log_softmax(logits.float() / (1.0 if greedy else temperature), dim=-1)
                if greedy:
                    choice = logprobs.argmax(-1)
                else:
                    choice = torch.multinomial(logprobs.exp(), 1, generator=self.generator).squeeze(-1)
                chosen_lp = logprobs.gather(-1, choice[:, None]).squeeze(-1)
                for i in torch.nonzero(~done).flatten().tolist():
                    t = int(choice[i])
                    tokens[i].append(t)
                    logps[i].append(float(chosen_lp[i]))
                    if t in stop:
                        done[i] = True
                        stopped[i] = True
                if bool(done.all()):
                    break
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
                out = self.model(
                    input_ids=choice[:, None],
                    attention_mask=mask,
                    position_ids=next_pos,
                    use_cache=True,
                    **{self._cache_kw: cache},
                )
                cache = getattr(out, self._cache_kw)
                logits = out.logits[:, -1, :]
                next_pos = next_pos + 1
        completions = [
            Completion(tokens[i], logps[i], "stop" if bool(stopped[i]) else "length", version) for i in range(len(rows))
        ]
        return [completions[k * n:(k + 1) * n] for k in range(len(prompts))]
