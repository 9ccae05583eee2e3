"""A vision-language model made locally, as a user's Hub model looks: Qwen2-VL's architecture at a
tiny size with the byte-level BPE tokenizer of tests/chat_models.py and the image processor."""

from __future__ import annotations

from pathlib import Path

from learner.models import create_tiny_qwen2_vl
from tests.chat_models import bpe_chat_tokenizer


def create_tiny_vlm(out_dir: str | Path, *, seed: int = 0) -> Path:
    return create_tiny_qwen2_vl(out_dir, bpe_chat_tokenizer(), seed=seed)
