"""Text to token ids and back with the served model's tokenizer, the same for every engine
(reference, vLLM, the process engine), so a prompt is tokenized alike whichever serves it."""

from __future__ import annotations


class Tokenizing:
    """Encoding and decoding with the model's tokenizer (``self.tokenizer``)."""

    tokenizer = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def encode_prompt(self, prompt: str | None, messages=None) -> list[int]:
        """A task's prompt: plain text as is; chat messages through the model's chat template
        (``role: content`` lines, then ``assistant:``, for a tokenizer without one).

        The template is rendered to text and the text encoded without adding special tokens: the
        template writes its own (BOS, ``<|im_start|>``), and ``tokenize=True`` returns a
        ``BatchEncoding`` in transformers 5 but a list in 4."""
        if not messages:
            return self.encode(prompt or "")
        turns = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            return self.encode(self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
        return self.encode("".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant: ")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
