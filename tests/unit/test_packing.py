"""Packed log-probs equal padded ones (values and gradients), without padding."""

from __future__ import annotations

import pytest
import torch

from learner.grpo import completion_logprobs
from learner.packing import block_causal_mask, pack_sequences, packed_completion_logprobs

PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14], [5]]
COMPLETIONS = [[5, 6, 7], [8, 9, 10, 11], [12], [6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from learner.models import create_tiny_llama
    from producers.suites.pyexpr import ALPHABET

    torch.manual_seed(0)
    m, tok = create_tiny_llama(tmp_path_factory.mktemp("m"), ALPHABET, seed=0)
    return m.eval(), tok.pad_token_id


def test_packs_hold_no_padding_and_restart_positions():
    packs = pack_sequences(PROMPTS, COMPLETIONS, pack_tokens=12)
    assert sum(p.tokens for p in packs) == sum(len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS))
    assert all(p.tokens <= 12 for p in packs)
    first = packs[0]
    assert first.position_ids[0, : first.lengths[0]].tolist() == list(range(first.lengths[0]))
    if len(first.lengths) > 1:
        assert first.position_ids[0, first.lengths[0]] == 0


def test_block_mask_is_causal_within_sequences_only():
    m = block_causal_mask([2, 3])[0, 0]
    assert m[1, 0] and not m[0, 1]  # causal
    assert not m[2, 1] and m[4, 2]  # nothing across the boundary


@pytest.mark.parametrize("pack_tokens", [64, 8])
def test_values_and_gradients_match_the_padded_computation(model, pack_tokens):
    m, pad = model
    ref = completion_logprobs(m, PROMPTS, COMPLETIONS, pad)
    m.zero_grad()
    torch.cat(ref).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    got = packed_completion_logprobs(m, PROMPTS, COMPLETIONS, pack_tokens=pack_tokens, chunk_tokens=3)
    torch.cat(got).sum().backward()
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, atol=1e-5)
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5), n


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
