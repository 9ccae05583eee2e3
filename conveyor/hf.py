"""Hugging Face model helpers the rollout engine, the learner and the launch layer share.

- :func:`resolve_model`: ``--model`` as a local directory or a Hub id through the local cache.
- :func:`encode_prompt`: a prompt as token ids, chat messages through the model's chat template
  (the rollout engines and the learner's SFT render alike).
- :func:`cache_keyword` and :func:`left_padded`: both the reference engine (to sample) and the
  learner (``learner/grpo.py``, to train) prefill each distinct prompt once with a KV cache and
  run the samples' tokens on it; the prompts are left-padded into one batch so every row's last
  position is its prompt's last token.
"""

from __future__ import annotations

import json
from pathlib import Path


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def encode_prompt(tokenizer, prompt: str | None, messages=None, tools=None) -> list[int]:
    """A task's prompt: plain text as is; chat messages (objects or dicts with ``role`` and
    ``content``) through the model's chat template, with the assistant's turn opened
    (``role: content`` lines, then ``assistant:``, for a tokenizer without a template).
    ``tools`` (a task's, OpenAI's function format) go to the template as its ``tools``; without
    a template they are a first ``tools:`` line of JSON.

    The template is rendered to text and the text encoded without adding special tokens: the
    template writes its own (BOS, ``<|im_start|>``), and ``tokenize=True`` returns a
    ``BatchEncoding`` in transformers 5 but a list in 4."""
    if not messages:
        return encode(tokenizer, prompt or "")
    # A text model sees an image as its marker; workers refuse image tasks for text models before this.
    turns = [m if isinstance(m, dict) else {"role": m.role, "content": m.text} for m in messages]
    turns = [{"role": m["role"], "content": m["content"]} for m in turns]
    specs = [t if t.get("type") == "function" else {"type": "function", "function": t} for t in tools or ()] or None
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(turns, tools=specs, add_generation_prompt=True, tokenize=False)
        return encode(tokenizer, text)
    head = f"tools: {json.dumps(specs)}\n" if specs else ""
    return encode(tokenizer, head + "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant: ")


_MARK_A, _MARK_O = "\x00conveyor-assistant\x00", "\x00conveyor-observation\x00"


def observation_frame(tokenizer, role: str) -> tuple[str, str] | None:
    """The text a chat template puts around an observation that follows an assistant turn: what
    closes the assistant's turn and opens ``role``'s, and what closes it and opens the assistant's
    next turn (ChatML: ``"<|im_end|>\\n<|im_start|>tool\\n"`` and ``"<|im_end|>\\n<|im_start|>assistant\\n"``).
    Found by rendering a conversation with marker contents; None when the tokenizer has no
    template, or the template does not render such a turn (then ``role`` ``user`` may)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    key = (id(tokenizer), str(template), role)  # rendered once per template and role, not per observation
    if key not in _frames:
        _frames[key] = _render_frame(tokenizer, role)
    return _frames[key]


_frames: dict[tuple[int, str, str], tuple[str, str] | None] = {}


def _render_frame(tokenizer, role: str) -> tuple[str, str] | None:
    turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK_A}, {"role": role, "content": _MARK_O}]
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the role (jinja raises its own errors)
        return None
    if (
        not isinstance(text, str)
        or text.count(_MARK_A) != 1
        or text.count(_MARK_O) != 1
        or text.index(_MARK_A) > text.index(_MARK_O)
    ):
        return None
    between, after = text.split(_MARK_A, 1)[1].split(_MARK_O, 1)
    return between, after


def observation_ids(tokenizer, text: str, role: str, *, ended_with_eos: bool) -> list[int]:
    """An observation as the tokens that follow the model's turn: framed as a ``role`` turn of
    the chat template (then ``user``), else plain text. The model's own tokens are not re-encoded:
    when its turn already ended with the EOS token the frame's copy of it is left out."""
    frame = observation_frame(tokenizer, role) or (observation_frame(tokenizer, "user") if role != "user" else None)
    if frame is None:
        return encode(tokenizer, text)
    between, after = frame
    eos = getattr(tokenizer, "eos_token", None)
    if ended_with_eos and eos and between.startswith(eos):
        between = between[len(eos) :]
    return encode(tokenizer, between + text + after)


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


class ModelNotFound(ValueError):
    """``--model`` names neither a model directory nor a Hub model that can be had here."""


def resolve_model(name: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The local directory of a model: ``name`` itself when it is a directory, else a Hugging
    Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``) resolved through the local Hub cache first
    (``HF_HUB_CACHE`` / ``HF_HOME``), then downloaded unless ``HF_HUB_OFFLINE=1``.

    Every service of a run resolves the same id to the same snapshot, so the rollout workers
    and the learner start from identical weights and tokenizer."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"model directory {path} has no config.json (not a Hugging Face model)")
        return path
    text = str(name)
    if path.exists() or text.count("/") != 1 or text.startswith((".", "/")):
        raise ModelNotFound(f"model {text!r}: not a model directory, nor a Hub id of the form owner/name")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(text, cache_dir=cache_dir, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except (HfHubHTTPError, ValueError) as exc:
        raise ModelNotFound(f"model {text!r}: {exc}") from None
    try:
        return Path(snapshot_download(text, cache_dir=cache_dir))
    except Exception as exc:  # noqa: BLE001 - offline mode, no network, unknown repo, no access: all say why
        raise ModelNotFound(
            f"model {text!r} is not in the local Hugging Face cache and could not be downloaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
