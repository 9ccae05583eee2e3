"""Text to token ids and back with the served model's tokenizer, the same for every engine
(reference, vLLM, the process engine), so a prompt is tokenized alike whichever serves it."""

from __future__ import annotations

from conveyor import hf


class Tokenizing:
    """Encoding and decoding with the model's tokenizer (``self.tokenizer``)."""

    tokenizer = None

    def encode(self, text: str) -> list[int]:
        return hf.encode(self.tokenizer, text)

    def encode_prompt(self, prompt: str | None, messages=None, tools=None) -> list[int]:
        """A task's prompt as token ids (``conveyor.hf.encode_prompt``: chat messages and the
        task's tools through the model's chat template)."""
        return hf.encode_prompt(self.tokenizer, prompt, messages, tools)

    def encode_observation(self, text: str, role: str, *, chat: bool, after: list[int]) -> list[int]:
        """An observation that follows the model's turn ``after``: for a chat task, framed as a
        ``role`` turn by the chat template (``conveyor.hf.observation_ids``); else plain text."""
        if not chat:
            return self.encode(text)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return hf.observation_ids(self.tokenizer, text, role, ended_with_eos=bool(after) and after[-1] == eos)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
