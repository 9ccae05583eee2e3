"""SFT on a user's demonstrations file: TRL's record layouts, rendered with the model's chat
template as the rollout engines render prompts, the reply learnt with its end of turn."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import hf
from learner.demonstrations import demonstration, demonstrations
from tests.chat_models import bpe_chat_tokenizer, create_tiny_qwen2_chat
from tests.cli import invoke

CHAT = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture(scope="module")
def tok():
    return bpe_chat_tokenizer()


def test_the_three_layouts(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt, completion = demonstration({"messages": [*CHAT, {"role": "assistant", "content": "42"}]}, tok)
    assert prompt == hf.encode_prompt(tok, None, CHAT)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n") and completion[-1] == end
    assert tok.decode(completion) == "42<|im_end|>"
    conversational = demonstration({"prompt": CHAT, "completion": [{"role": "assistant", "content": "42"}]}, tok)
    assert conversational == (prompt, completion)
    plain = demonstration({"prompt": "12 + 30 =", "completion": " 42"}, tok)
    assert plain == (hf.encode(tok, "12 + 30 ="), hf.encode(tok, " 42") + [end])


def test_bad_records_are_named(tok):
    records = [
        ("f:1", {"messages": [*CHAT]}),  # no reply
        ("f:2", {"prompt": "x"}),
        ("f:3", {"prompt": 3, "completion": "y"}),
        ("f:4", {"prompt": "x", "completion": "   "}),
        ("f:5", {"prompt": "x", "completion": "a long reply " * 20}),
        ("f:6", {"prompt": "x", "completion": "ok"}),
    ]
    examples, bad = demonstrations(records, tok, max_tokens=40)
    assert len(examples) == 1
    assert [str(b).split(":")[0:3] for b in bad][0][:2] == ["f", "1"]
    reasons = {b.where: b.reason for b in bad}
    assert "assistant" in reasons["f:1"] and "prompt and completion" in reasons["f:2"]
    assert "prompt" in reasons["f:3"] and "empty" in reasons["f:4"] and "over the limit" in reasons["f:5"]


def test_the_sft_command_teaches_the_reply(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.grpo import completion_logprobs

    made = bpe_chat_tokenizer()
    base = create_tiny_qwen2_chat(tmp_path / "base", tokenizer=made)
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(8)
    ]
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    cli = [
        "train",
        "sft",
        "--data",
        str(data),
        "--model",
        str(base),
        "--out",
        str(tmp_path / "sft"),
        "--epochs",
        "30",
        "--lr",
        "3e-3",
    ]
    refused = invoke(monkeypatch, cli)
    assert refused.exit_code == 2 and "demos.jsonl:9" in refused.output
    ok = invoke(monkeypatch, [*cli, "--on-error", "skip", "--batch-size", "8"])
    assert ok.exit_code == 0, ok.output
    stats = json.loads((tmp_path / "sft" / "offline_stats.json").read_text())
    assert stats["examples"] == 8 and stats["skipped"] == 1 and stats["loss_last"] < stats["loss_first"] / 2

    tok = AutoTokenizer.from_pretrained(tmp_path / "sft")
    prompt, completion = demonstration(rows[3], tok)
    pad = tok.pad_token_id

    def logp(model_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        with torch.no_grad():
            return float(completion_logprobs(model, [prompt], [completion], pad)[0].sum())

    assert logp(tmp_path / "sft") > logp(base) + 5.0
