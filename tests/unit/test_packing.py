"""Packed log-probs equal padded ones (values and gradients), without padding."""

from __future__ import annotations

import pytest
import torch

from learner import grpo
from learner.grpo import completion_logprobs
from learner.packing import pack_sequences, packed_completion_logprobs, shares_prompts

PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14], [5]]
COMPLETIONS = [[5, 6, 7], [8, 9, 10, 11], [12], [6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    torch.manual_seed(0)
    m, tok = create_tiny_llama(tmp_path_factory.mktemp("m"), ALPHABET, seed=0)
    return m.eval(), tok.pad_token_id


def test_packs_hold_no_padding_and_restart_positions():
    packs = pack_sequences(PROMPTS, COMPLETIONS, pack_tokens=12)
    assert sum(p.tokens for p in packs) == sum(len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS))
    assert all(p.tokens <= 12 for p in packs)
    first = packs[0]
    (_, ps, plen, cs, k), *rest = first.spans
    assert first.position_ids[0, ps : cs + k].tolist() == list(range(plen + k))
    if rest:
        assert first.position_ids[0, rest[0][1]] == 0


def test_a_shared_prompt_is_packed_once_and_its_completions_do_not_see_each_other():
    prompts = [[3, 4], [7, 8, 9], [3, 4], [3, 4]]
    completions = [[5, 6], [10], [11, 12], [13]]
    (pack,) = pack_sequences(prompts, completions, pack_tokens=64)
    assert pack.input_ids[0].tolist() == [3, 4, 5, 6, 11, 12, 13, 7, 8, 9, 10]
    assert pack.position_ids[0].tolist() == [0, 1, 2, 3, 2, 3, 2, 0, 1, 2, 3]
    assert [s[0] for s in pack.spans] == [0, 2, 3, 1]
    m = pack.attention_mask()[0, 0]
    assert m[1, 0] and not m[0, 1]  # causal
    assert m[4, 0] and m[4, 1] and not m[4, 2] and not m[4, 3]  # completion 2 sees the prompt, not completion 1
    assert m[5, 4] and not m[6, 5] and m[6, 1]
    assert not m[7, 6] and not m[10, 1] and m[10, 7]  # nothing across units
    unshared = pack_sequences(prompts, completions, pack_tokens=64, share_prompts=False)
    assert sum(p.tokens for p in unshared) == pack.tokens + 2 * 2
    # A group that does not fit one pack is split, each part with its own copy of the prompt.
    packs = pack_sequences(prompts, completions, pack_tokens=5)
    assert all(p.tokens <= 5 for p in packs)
    assert sorted(s[0] for p in packs for s in p.spans) == [0, 1, 2, 3]
    assert sum(p.tokens for p in packs) == pack.tokens + 2  # the prompt [3, 4] twice: two parts


# A batch with GRPO-style repeats: prompt 0 three times (interleaved), prompt 2 twice, an empty completion.
SHARED_PROMPTS = PROMPTS + [PROMPTS[0], PROMPTS[2], PROMPTS[0]]
SHARED_COMPLETIONS = COMPLETIONS + [[8, 9], [4, 5, 6], []]


@pytest.mark.parametrize(("prompts", "completions"), [(PROMPTS, COMPLETIONS), (SHARED_PROMPTS, SHARED_COMPLETIONS)],
                         ids=["distinct", "shared"])  # fmt: skip
@pytest.mark.parametrize("share_prompts", [None, False], ids=["default", "unshared"])
@pytest.mark.parametrize("pack_tokens", [64, 8])
def test_values_and_gradients_match_the_padded_computation(model, pack_tokens, prompts, completions, share_prompts):
    m, pad = model
    weights = torch.linspace(-1, 1, sum(len(c) for c in completions))
    ref = grpo.whole_sequence_logprobs(m, prompts, completions, pad, None, None)  # every sequence whole
    m.zero_grad()
    (torch.cat(ref) * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    got = packed_completion_logprobs(
        m, prompts, completions, pack_tokens=pack_tokens, chunk_tokens=3, share_prompts=share_prompts
    )
    (torch.cat(got) * weights).sum().backward()
    assert [len(x) for x in got] == [len(c) for c in completions]
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, atol=1e-5)
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5), n


@pytest.mark.parametrize("pack_tokens", [64, 8])
def test_flex_attention_takes_the_tree_and_matches_the_padded_computation(model, pack_tokens):
    """FlexAttention's block mask is the boolean mask's rule: shared prompts laid down once, values
    equal to every sequence run whole (sdpa, padded). Values only: PyTorch has no FlexAttention
    backward on CPU (training with it needs a CUDA GPU, checked at start)."""
    m, pad = model
    with torch.no_grad():
        ref = grpo.whole_sequence_logprobs(m, SHARED_PROMPTS, SHARED_COMPLETIONS, pad, None, None)
        m.set_attn_implementation("flex_attention")
        try:
            assert shares_prompts(m)  # the packs hold a tree: each repeated prompt once
            got = packed_completion_logprobs(m, SHARED_PROMPTS, SHARED_COMPLETIONS, pack_tokens=pack_tokens, chunk_tokens=3)
        finally:
            m.set_attn_implementation("sdpa")
    assert [len(x) for x in got] == [len(c) for c in SHARED_COMPLETIONS]
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, atol=1e-5)


def test_tempered_logprobs_match_between_paths_and_the_definition(model):
    m, pad = model
    temps = [0.5, 1.0, 1.7][: len(PROMPTS)] + [0.8] * max(0, len(PROMPTS) - 3)
    with torch.no_grad():
        padded = completion_logprobs(m, PROMPTS, COMPLETIONS, pad, temperatures=temps)
        packed = packed_completion_logprobs(m, PROMPTS, COMPLETIONS, pack_tokens=8, chunk_tokens=3, temperatures=temps)
        for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
            logits = m(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float() / temps[i]
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
            assert torch.allclose(padded[i], want, atol=1e-5) and torch.allclose(packed[i], want, atol=1e-5)
    assert not torch.allclose(padded[0], completion_logprobs(m, PROMPTS[:1], COMPLETIONS[:1], pad)[0])


def test_a_shared_prompt_is_refused_under_flash_attention(model):
    m, _ = model
    before = m.config._attn_implementation
    m.config._attn_implementation = "flash_attention_2"  # checked before any forward: no flash-attn needed
    try:
        with pytest.raises(ValueError, match="flash-attn"):
            packed_completion_logprobs(m, SHARED_PROMPTS, SHARED_COMPLETIONS, share_prompts=True)
    finally:
        m.config._attn_implementation = before


def test_the_configured_attention_kernel_is_the_models_and_one_that_cannot_run_is_refused(tmp_path):
    """``learner.attn_implementation`` reaches the model load_policy builds; flash_attention_2 is refused at
    start where it cannot run (no flash-attn, no CUDA), naming the field; eager is not a choice."""
    from pydantic import ValidationError

    from conveyor.config import RunConfig
    from conveyor.errors import ConfigError
    from learner.build import load_policy
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    policy, _ = load_policy(tmp_path / "m", RunConfig(learner={"attn_implementation": "sdpa"}))
    assert policy.config._attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="learner.attn_implementation: flex_attention"):
        load_policy(tmp_path / "m", RunConfig(learner={"attn_implementation": "flex_attention"}))
    with pytest.raises(ConfigError, match="learner.attn_implementation: flash_attention_2"):
        load_policy(tmp_path / "m", RunConfig(learner={"attn_implementation": "flash_attention_2"}))
    with pytest.raises(ValidationError, match="attn_implementation"):
        RunConfig(learner={"attn_implementation": "eager"})
