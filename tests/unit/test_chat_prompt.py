"""Chat prompts go through the model's own chat template, as token ids (not the keys of the
``BatchEncoding`` that transformers 5 returns from ``apply_chat_template(tokenize=True)``)."""

from __future__ import annotations

import pytest

from conveyor.contracts import ChatMessage
from rollout_workers.tokenizing import Tokenizing
from tests.chat_models import bpe_chat_tokenizer, create_tiny_qwen2_chat

pytest.importorskip("transformers")


class _Engine(Tokenizing):
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer


MESSAGES = [
    ChatMessage(role="system", content="You are a helpful assistant."),
    ChatMessage(role="user", content="What is 12 + 30?"),
]


def test_a_chat_prompt_is_the_templates_rendering_as_token_ids():
    tok = bpe_chat_tokenizer()
    ids = _Engine(tok).encode_prompt(None, MESSAGES)
    assert ids and all(isinstance(i, int) for i in ids)
    rendered = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == rendered
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # special tokens stay single tokens
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2


def test_the_saved_model_directory_loads_with_its_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = bpe_chat_tokenizer()
    model_dir = create_tiny_qwen2_chat(tmp_path / "m", tokenizer=made)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert AutoModelForCausalLM.from_pretrained(model_dir).config.model_type == "qwen2"
    assert tok.chat_template == made.chat_template
    assert _Engine(tok).encode_prompt(None, MESSAGES) == _Engine(made).encode_prompt(None, MESSAGES)


def test_a_plain_prompt_is_encoded_as_is():
    tok = bpe_chat_tokenizer()
    assert _Engine(tok).encode_prompt("What is 12 + 30?") == tok("What is 12 + 30?", add_special_tokens=False).input_ids


def test_the_reference_engine_serves_a_chat_model_and_stops_at_its_end_of_turn(tmp_path):
    from transformers import GenerationConfig

    from rollout_workers.reference_engine import ReferenceEngine

    made = bpe_chat_tokenizer()
    model_dir = create_tiny_qwen2_chat(tmp_path / "m", tokenizer=made)
    end_of_turn, end_of_text = made.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    GenerationConfig(eos_token_id=[end_of_turn, end_of_text]).save_pretrained(model_dir)
    engine = ReferenceEngine(model_dir, seed=0)
    assert engine.eos_token_ids == {end_of_turn, end_of_text}
    prompt = engine.encode_prompt(None, MESSAGES)
    assert prompt == _Engine(made).encode_prompt(None, MESSAGES)  # the engine renders as the tokenizer does
    ((a, b),) = engine.generate([prompt], 2, max_new_tokens=6)
    assert len(a.token_ids) == len(a.logprobs) and all(x <= 0 for x in a.logprobs)
