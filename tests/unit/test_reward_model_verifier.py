"""The ``reward_model`` verifier: a sequence-classification model made locally scores (prompt,
completion) pairs in one batch, normalised as the task says; one it cannot load is an error."""

from __future__ import annotations

import pytest

from conveyor.contracts import ChatMessage, Task, VerifierSpec
from tasks.verifiers import score_batch

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=?\n"


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from learner.models import char_tokenizer

    out = tmp_path_factory.mktemp("rm") / "rm"
    tok = char_tokenizer(ALPHABET)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=128, num_labels=1, pad_token_id=tok.pad_token_id)  # fmt: skip
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def rm_task(i, model, prompt="what is 2 plus 2?", **data):
    return Task(
        task_id=f"t{i}", run_id="r", prompt=prompt, verifier=VerifierSpec(kind="reward_model", data={"model": str(model), **data})
    )


def test_scores_are_the_models_and_a_batch_equals_one_at_a_time(rm_dir):
    completions = ["4", "four", "it is 4 for sure", "5"]
    batch = score_batch(None, [(rm_task(i, rm_dir), c) for i, c in enumerate(completions)])
    alone = [score_batch(None, [(rm_task(0, rm_dir), c)])[0] for c in completions]
    assert [v.reward for v in batch] == pytest.approx([v.reward for v in alone], abs=1e-5)
    assert len({round(v.reward, 6) for v in batch}) == 4  # the completion changes the score
    assert all(v.verdict == ("pass" if v.reward >= 0 else "fail") for v in batch)
    assert batch[0].details["rm_score"] == pytest.approx(batch[0].reward)


def test_normalised_and_thresholded_as_the_task_says(rm_dir):
    [raw] = score_batch(None, [(rm_task(0, rm_dir), "4")])
    [norm] = score_batch(None, [(rm_task(0, rm_dir, mean=raw.reward, std=2.0, pass_at=0.5), "4")])
    assert norm.reward == pytest.approx(0.0, abs=1e-5) and norm.verdict == "fail"


def test_a_chat_prompt_is_scored_through_the_models_template(rm_dir):
    chat = Task(task_id="c", run_id="r", messages=[ChatMessage(role="user", content="what is 2 plus 2?")],
                verifier=VerifierSpec(kind="reward_model", data={"model": str(rm_dir)}))  # fmt: skip
    [as_chat] = score_batch(None, [(chat, "4")])
    [as_text] = score_batch(None, [(rm_task(0, rm_dir, prompt="user: what is 2 plus 2?\nassistant: "), "4\n")])
    assert as_chat.reward == pytest.approx(as_text.reward, abs=1e-5)


def test_a_model_that_cannot_be_loaded_is_an_error_naming_it(tmp_path):
    no_model = Task(task_id="n", run_id="r", prompt="p", verifier=VerifierSpec(kind="reward_model", data={}))
    out = score_batch(None, [(rm_task(0, tmp_path / "absent"), "4"), (no_model, "4")])
    assert out[0].verdict == "error" and "absent" in out[0].feedback.message
    assert out[1].verdict == "error" and "needs data.model" in out[1].feedback.message
