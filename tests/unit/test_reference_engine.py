"""The reference engine's logprobs agree with the learner's recomputation."""

from __future__ import annotations

import pytest
import torch

from learner.grpo import completion_logprobs
from learner.models import create_tiny_llama
from rollout_workers.reference_engine import ReferenceEngine
from tasks.suites.pyexpr import ALPHABET


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    create_tiny_llama(d, ALPHABET, seed=3, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    return ReferenceEngine(d, seed=0)


def test_sampled_logprobs_match_the_learners_recomputation(engine):
    prompts = [engine.encode("a = [1, 2, 3, 4]\nassert a[0] =="), engine.encode("a = [9]\nassert max(a) ==")]
    groups = engine.generate(prompts, 4, max_new_tokens=6, temperature=1.0)
    flat_p = [p for p, g in zip(prompts, groups) for _ in g]
    flat_c = [c for g in groups for c in g]
    with torch.no_grad():
        recomputed = completion_logprobs(engine.model, flat_p, [c.token_ids for c in flat_c], engine.tokenizer.pad_token_id)
    diffs = torch.cat([(r - torch.tensor(c.logprobs)).abs() for r, c in zip(recomputed, flat_c)])
    assert float(diffs.max()) < 1e-4, f"train/inference logprob mismatch {float(diffs.max())}"


def test_groups_stop_at_the_stop_token_and_record_the_version(engine):
    newline = engine.encode("\n")[0]
    engine.load_state_dict(engine.model.state_dict(), 7)
    groups = engine.generate([engine.encode("a = [1]\nassert a[0] ==")], 8, max_new_tokens=4, stop_token_ids={newline})
    assert len(groups) == 1 and len(groups[0]) == 8
    for c in groups[0]:
        assert c.policy_version == 7
        assert len(c.token_ids) == len(c.logprobs) <= 4
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in (newline, engine.tokenizer.eos_token_id)
        else:
            assert len(c.token_ids) == 4


def test_greedy_is_deterministic(engine):
    p = [engine.encode("a = [5, 6]\nassert a[1] ==")]
    a = engine.generate(p, 2, max_new_tokens=5, greedy=True)[0]
    b = engine.generate(p, 1, max_new_tokens=5, greedy=True)[0]
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids


def test_chat_messages_are_rendered_not_dropped(tmp_path):
    from conveyor.contracts import ChatMessage
    from learner.models import create_tiny_llama
    from rollout_workers.reference_engine import ReferenceEngine
    from tasks.suites.pyexpr import ALPHABET

    create_tiny_llama(tmp_path, "".join(sorted(set(ALPHABET + "abcdefghijklmnopqrstuvwxyz:"))), seed=0)
    eng = ReferenceEngine(tmp_path)
    ids = eng.encode_prompt(None, [ChatMessage(role="user", content="a = [1]")])
    assert eng.decode(ids) == "user: a = [1]\nassistant: "
    assert eng.encode_prompt("a = [1]") == eng.encode("a = [1]")


def test_process_engine_samples_like_the_in_process_one(tmp_path):
    from learner.models import create_tiny_llama
    from rollout_workers.process_engine import ProcessEngine
    from rollout_workers.reference_engine import ReferenceEngine
    from tasks.suites.pyexpr import ALPHABET

    model, _ = create_tiny_llama(tmp_path, ALPHABET, seed=0)
    local, remote = ReferenceEngine(tmp_path, seed=0), ProcessEngine(tmp_path, seed=0)
    try:
        prompt = [local.encode("a = [1]")]
        greedy = dict(max_new_tokens=5, greedy=True)
        assert [c.token_ids for c in remote.generate(prompt, 2, **greedy)[0]] == [
            c.token_ids for c in local.generate(prompt, 2, **greedy)[0]
        ]
        state = {k: v * 0 for k, v in model.state_dict().items()}
        remote.load_state_dict(state, 7)
        assert remote.version == 7 and remote.generate(prompt, 1, **greedy)[0][0].policy_version == 7
    finally:
        remote.close()


def test_process_engine_swaps_to_a_published_blob_and_refuses_one_that_does_not_fit(tmp_path):
    """BatchingEngine hands a ProcessEngine the safetensors blob as published (tied head once);
    the child decodes it. A blob that does not fit is refused and the served version stays."""
    import asyncio

    from safetensors.torch import save

    from rollout_workers.engine import BatchingEngine, WeightsRejected
    from rollout_workers.process_engine import ProcessEngine

    create_tiny_llama(tmp_path / "a", ALPHABET, seed=0)
    other, _ = create_tiny_llama(tmp_path / "b", ALPHABET, seed=1)
    small, _ = create_tiny_llama(tmp_path / "c", ALPHABET, seed=1, hidden_size=32, layers=2, heads=2, intermediate_size=64)

    def blob(model) -> bytes:
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        return save(state)

    local, remote = ReferenceEngine(tmp_path / "b", seed=0), ProcessEngine(tmp_path / "a", seed=0)
    engine = BatchingEngine(remote)
    prompt = [local.encode("a = [1, 5]\nassert max(a) ==")]
    greedy = dict(max_new_tokens=5, greedy=True)

    async def go():
        before = remote.generate(prompt, 1, **greedy)[0][0]
        await engine.swap(blob(other), 3)
        assert engine.version == 3
        got, want = remote.generate(prompt, 1, **greedy)[0][0], local.generate(prompt, 1, **greedy)[0][0]
        assert got.token_ids == want.token_ids and torch.allclose(
            torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5
        )
        assert got.token_ids != before.token_ids or not torch.allclose(
            torch.tensor(got.logprobs), torch.tensor(before.logprobs), atol=1e-3
        )
        with pytest.raises(WeightsRejected):
            await engine.swap(blob(small), 4)  # wrong shapes: refused before it reaches the child
        with pytest.raises(WeightsRejected):
            remote.load_weights(b"\x08" + bytes(15), 5)  # not safetensors: refused by the child
        assert engine.version == 3 and remote.generate(prompt, 1, **greedy)[0][0].policy_version == 3

    try:
        asyncio.run(go())
    finally:
        remote.close()


def test_tempered_sampling_logprobs_match_the_learners_tempered_recomputation(engine):
    prompts = [engine.encode("a = [3, 1]\nassert min(a) ==")]
    groups = engine.generate(prompts, 4, max_new_tokens=6, temperature=0.6)
    comps = [c.token_ids for c in groups[0]]
    with torch.no_grad():
        recomputed = completion_logprobs(engine.model, prompts * 4, comps, engine.tokenizer.pad_token_id, temperatures=[0.6] * 4)
    diffs = torch.cat([(r - torch.tensor(c.logprobs)).abs() for r, c in zip(recomputed, groups[0])])
    assert float(diffs.max()) < 1e-4
