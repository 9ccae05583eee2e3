"""Reference engine: batched sampling with a KV cache in plain PyTorch/transformers.

For machines without vLLM, and as the correctness oracle for the vLLM
backend. Prompts are left-padded into one batch and prefilled once each; the
KV cache is then repeated for each prompt's ``n`` samples; every step samples
from ``softmax(logits / temperature)`` and records
the log-probability of the sampled token *under that same distribution*, so
the learner's importance ratios compare like with like.

Weights swap between batches (``load_state_dict``); the version that
produced a batch is recorded with it.
"""

from __future__ import annotations

import threading
from pathlib import Path

from conveyor.hf import cache_keyword, left_padded
from rollout_workers.engine import Completion, WeightsRejected
from rollout_workers.tokenizing import Tokenizing


class ReferenceEngine(Tokenizing):
    def __init__(self, model_dir: str | Path, *, seed: int = 0, threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.model_dir = Path(model_dir)  # its own weights: the base of LoRA versions
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self._lock = threading.Lock()
        self._cache_kw = cache_keyword(self.model)

    @property
    def max_context(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def eos_token_ids(self) -> set[int]:
        """Where a completion ends: the tokenizer's EOS and the generation config's (a chat model's
        end-of-turn, ``<|im_end|>``, is often only there), as vLLM stops."""
        ids = {self.tokenizer.eos_token_id}
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return {int(i) for i in ids if i is not None}

    def load_state_dict(self, state: dict, version: int) -> None:
        """Swap to ``state`` (a full or HF-style state dict, tied weights stored once)."""
        with self._lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
            if unexpected or set(missing) - tied:
                raise ValueError(f"weights do not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
            self.version = version

    def load_weights(self, weights: bytes, version: int) -> None:
        """Swap to a safetensors blob as the learner publishes it (a tied head stored once);
        a blob that cannot be read or does not fit raises :class:`WeightsRejected`, nothing loaded."""
        from safetensors.torch import load

        try:
            state = load(weights)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise WeightsRejected(f"not a safetensors object: {exc}") from None
        try:
            self.load_state_dict(state, version)
        except (ValueError, RuntimeError) as exc:  # torch refuses a wrong shape before it copies
            raise WeightsRejected(str(exc)) from None

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

        stop = set(stop_token_ids or ()) | self.eos_token_ids
        batch = len(prompts) * n  # sample rows: prompt k's samples are rows k*n .. k*n+n-1
        if batch == 0:
            return []
        ids, mask, positions = left_padded(prompts, self.tokenizer.pad_token_id)
        with self._lock, torch.inference_mode():
            version = self.version
            # Each prompt is prefilled once and its KV cache repeated for its n samples (the
            # demo's prompts are 32 tokens and its completions at most 5: prefilling every
            # sample was most of the engine's time).
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            cache = getattr(out, self._cache_kw)
            logits = out.logits[:, -1, :]
            next_pos = positions[:, -1:] + 1
            if n > 1:
                cache.batch_repeat_interleave(n)
                logits, mask, next_pos = (t.repeat_interleave(n, dim=0) for t in (logits, mask, next_pos))
            steps_tokens: list[torch.Tensor] = []
            steps_logps: list[torch.Tensor] = []
            done = torch.zeros(batch, dtype=torch.bool)
            stop_ids = torch.tensor(sorted(stop), dtype=torch.long)
            for _ in range(max_new_tokens):
                logprobs = torch.log_softmax(logits.float() / (1.0 if greedy else temperature), dim=-1)
                if greedy:
                    choice = logprobs.argmax(-1)
                else:
                    choice = torch.multinomial(logprobs.exp(), 1, generator=self.generator).squeeze(-1)
                steps_tokens.append(choice)
                steps_logps.append(logprobs.gather(-1, choice[:, None]).squeeze(-1))
                done |= torch.isin(choice, stop_ids)
                if bool(done.all()):
                    break
                mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
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
        # Cut each row after its first stop token (rows that finished early
        # kept sampling in the batch; those tokens are discarded).
        all_tokens = torch.stack(steps_tokens, dim=1)
        all_logps = torch.stack(steps_logps, dim=1)
        is_stop = torch.isin(all_tokens, stop_ids)
        first_stop = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.full((batch,), all_tokens.shape[1]))
        token_rows = all_tokens.tolist()
        logp_rows = all_logps.tolist()
        lengths = first_stop.tolist()
        stopped = is_stop.any(1).tolist()
        tokens = [token_rows[i][: lengths[i]] for i in range(batch)]
        logps = [logp_rows[i][: lengths[i]] for i in range(batch)]
        completions = [Completion(tokens[i], logps[i], "stop" if stopped[i] else "length", version) for i in range(batch)]
        return [completions[k * n : (k + 1) * n] for k in range(len(prompts))]
