"""A chat task's feedback turn is framed by the model's own chat template (ChatML here): the model
reads ``<|im_start|>user ... <|im_end|><|im_start|>assistant`` between its attempts, its own
tokens are never re-encoded, and the frame carries loss mask 0 like the observation."""

from __future__ import annotations

import pytest

from conveyor.contracts import ChatMessage, VerifierSpec
from conveyor.hf import observation_frame, observation_ids
from tests.chat_models import bpe_chat_tokenizer, create_tiny_qwen2_chat

pytestmark = pytest.mark.unit


def test_the_frame_is_read_off_the_template_and_an_ended_turn_is_not_closed_twice():
    tok = bpe_chat_tokenizer()
    assert observation_frame(tok, "tool") == ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    closed = tok.decode(observation_ids(tok, "exit 1", "tool", ended_with_eos=True))
    assert closed == "\n<|im_start|>tool\nexit 1<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(observation_ids(tok, "exit 1", "tool", ended_with_eos=False)).startswith("<|im_end|>\n<|im_start|>tool")
    tok.chat_template = None
    assert observation_ids(tok, "exit 1", "tool", ended_with_eos=True) == tok("exit 1", add_special_tokens=False).input_ids


def test_a_template_that_refuses_the_role_falls_back_to_a_user_turn():
    tok = bpe_chat_tokenizer()
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}" + tok.chat_template[len("{% for m in messages %}"):]  # fmt: skip
    assert observation_frame(tok, "tool") is None
    assert tok.decode(observation_ids(tok, "x", "tool", ended_with_eos=False)).startswith("<|im_end|>\n<|im_start|>user\n")


async def test_episodes_of_a_chat_task_frame_each_feedback_turn(tmp_path):
    from reward.scorers import LocalScorer
    from rollout_workers.reference_engine import ReferenceEngine
    from tests.unit.test_rollout_worker import _pipeline

    tok = bpe_chat_tokenizer()
    engine = ReferenceEngine(create_tiny_qwen2_chat(tmp_path / "m", tokenizer=tok, max_positions=1024), seed=0)
    chat = {"prompt": None, "messages": [ChatMessage(role="user", content="What is 12 + 30?")], "max_turns": 2,
            "verifier": VerifierSpec(kind="math", data={"answer": "-999"})}  # fmt: skip
    worker, rollouts, committed, error = await _pipeline(tmp_path, engine, n_tasks=2, scorer=LocalScorer(None), task_kw=chat)
    assert error is None and rollouts
    retried = 0
    for r in rollouts:
        ids, mask = r.completion_token_ids.tolist(), r.loss_mask.tolist()
        if [t.role for t in r.turns] != ["assistant", "user", "assistant"]:
            continue
        retried += 1
        observed = tok.decode([t for t, m in zip(ids, mask) if m == 0])
        assert "<|im_start|>user\n" in observed and observed.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert r.turns[1].text in observed
        assert tok.decode([t for t, m in zip(ids, mask) if m == 1]) == "".join(t.text for t in r.turns if t.role == "assistant")
    assert retried, "no episode had a second attempt"
