"""Log-probabilities of a vision-language model's completions, with the prompts' images.

Every sequence runs whole (right-padded, no packing): the model computes its M-RoPE positions
from the token ids, ``mm_token_type_ids`` and ``image_grid_thw``, which packing several
documents into one row would break. The images' pads are prompt tokens, so they are context and
never loss tokens: only completion tokens get a log-probability. The engine never samples an
image placeholder (a completion holding one would be read as an image slot without an image),
and the learner takes those tokens out of the distribution the same way. The pixels come from the same
image processor the rollout engine used (``conveyor/vision.py``), so the learner sees the
patches the engine saw.
"""

from __future__ import annotations

from typing import Any

import torch

from learner.grpo import check_prompts, whole_sequence_logprobs


def vision_logprobs(
    model,
    vision,
    prompts: list[list[int]],
    completions: list[list[int]],
    images: list[list[Any]] | None,
    pad_id: int,
    entropy: list | None = None,
    temperatures: list[float] | None = None,
    token_entropies: list | None = None,
) -> list[torch.Tensor]:
    """``learner.grpo.completion_logprobs`` for a vision-language model; ``images[i]``: sequence
    i's pictures (PIL), in prompt order; ``vision``: its ``conveyor.vision.VisionPrompting``."""
    check_prompts(prompts, completions)
    pictures = [img for row in images or () for img in row]
    pixels = vision.pixel_inputs(pictures) if pictures else None

    def extra(ids: torch.Tensor) -> dict:
        if pixels is None:
            return {}
        return {**{k: v.to(ids.device) for k, v in pixels.items()}, "mm_token_type_ids": vision.image_mask(ids)}

    return whole_sequence_logprobs(model, prompts, completions, pad_id, entropy, temperatures, token_entropies, extra,
                                   suppress=vision.placeholder_ids)  # fmt: skip
