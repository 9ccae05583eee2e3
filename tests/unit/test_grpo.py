from __future__ import annotations

import pytest
import torch

from learner.grpo import LossConfig, clipped_pg_loss, group_advantages


def test_zero_variance_group_carries_no_signal():
    assert group_advantages([1.0, 1.0, 1.0]) is None
    assert group_advantages([0.0] * 8) is None


def test_advantages_are_centred_and_normalised():
    adv = torch.tensor(group_advantages([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]))
    assert float(adv.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(adv.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    raw = group_advantages([1.0, 0.0], std_normalise=False)
    assert raw == pytest.approx([0.5, -0.5])


def _loss(new: float, old: float, adv: float, cfg=LossConfig()):
    lp = torch.tensor([new], requires_grad=True)
    loss, stats = clipped_pg_loss([lp], [torch.tensor([old])], [adv], [torch.ones(1)], cfg)
    loss.backward()
    return loss.item(), float(lp.grad[0]), stats


def test_on_policy_gradient_raises_logprob_of_good_samples():
    loss, grad, stats = _loss(-1.0, -1.0, adv=1.0)
    assert loss == pytest.approx(-1.0)
    assert grad < 0  # minimising the loss increases the logprob
    assert stats["importance_mean"] == pytest.approx(1.0)
    _, grad_bad, _ = _loss(-1.0, -1.0, adv=-1.0)
    assert grad_bad > 0


def test_ratio_beyond_clip_high_stops_the_gradient_for_positive_advantage():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    _, grad, stats = _loss(-1.0 + 0.5, -1.0, adv=1.0, cfg=cfg)  # ratio e^0.5 = 1.65 > 1.28
    assert grad == 0.0 and stats["clip_fraction"] == 1.0
    _, grad_inside, _ = _loss(-1.0 + 0.2, -1.0, adv=1.0, cfg=cfg)  # ratio 1.22 < 1.28
    assert grad_inside < 0


def test_negative_advantage_is_not_clipped_when_ratio_is_high():
    # PPO keeps the pessimistic (unclipped) term: a bad sample that became likelier is pushed down.
    _, grad, _ = _loss(-1.0 + 0.5, -1.0, adv=-1.0)
    assert grad > 0


def test_token_and_sequence_aggregation_differ_on_unequal_lengths():
    new = [torch.zeros(1), torch.zeros(3)]
    old = [torch.zeros(1), torch.zeros(3)]
    masks = [torch.ones(1), torch.ones(3)]
    tok, _ = clipped_pg_loss(new, old, [1.0, -1.0], masks, LossConfig(aggregation="token"))
    seq, _ = clipped_pg_loss(new, old, [1.0, -1.0], masks, LossConfig(aggregation="sequence"))
    assert float(tok) == pytest.approx((-1 + 3) / 4)
    assert float(seq) == pytest.approx(0.0)


def _dec(new: float, prox: float, old: float, adv: float, cfg=LossConfig(objective="decoupled")):
    lp = torch.tensor([new], requires_grad=True)
    loss, stats = clipped_pg_loss(
        [lp], [torch.tensor([old])], [adv], [torch.ones(1)], cfg, proximal_logprobs=[torch.tensor([prox])]
    )
    loss.backward()
    return loss.item(), float(lp.grad[0]), stats


def test_decoupled_clips_around_the_proximal_policy_not_the_behaviour_one():
    # A stale sample: behaviour logprob far below the current policy's. Against the
    # behaviour policy the ratio (e^1.0) is far outside the clip range: no gradient.
    _, grad_behaviour, _ = _loss(-1.0, -2.0, adv=1.0)
    assert grad_behaviour == 0.0
    # Decoupled: the trust region is around the proximal (current) policy, so the
    # first update still learns, weighted by the truncated pi_prox / pi_behaviour.
    loss, grad, stats = _dec(-1.0, -1.0, -2.0, adv=1.0)
    assert grad < 0
    assert stats["importance_mean"] == pytest.approx(float(torch.exp(torch.tensor(1.0))), rel=1e-5)
    assert loss == pytest.approx(-float(torch.exp(torch.tensor(1.0))), rel=1e-5)


def test_decoupled_weight_is_truncated():
    cfg = LossConfig(objective="decoupled", max_importance_weight=2.0)
    loss, _, _ = _dec(-1.0, -1.0, -5.0, adv=1.0, cfg=cfg)  # pi_prox / pi_behaviour = e^4, truncated at 2
    assert loss == pytest.approx(-2.0)


def test_decoupled_needs_proximal_logprobs():
    with pytest.raises(ValueError, match="proximal"):
        clipped_pg_loss([torch.zeros(1)], [torch.zeros(1)], [1.0], [torch.ones(1)], LossConfig(objective="decoupled"))


def test_on_policy_ignores_the_behaviour_logprobs():
    cfg = LossConfig(objective="on_policy")
    _, g1, _ = _loss(-1.0, -1.0, adv=1.0, cfg=cfg)
    _, g2, _ = _loss(-1.0, -5.0, adv=1.0, cfg=cfg)
    assert g1 == pytest.approx(g2) == pytest.approx(-1.0)


def test_kl_penalty_pulls_towards_the_reference():
    cfg = LossConfig(objective="on_policy", kl_coef=0.5)
    lp = torch.tensor([-0.5], requires_grad=True)
    loss, stats = clipped_pg_loss(
        [lp], [torch.tensor([-0.5])], [0.0], [torch.ones(1)], cfg, reference_logprobs=[torch.tensor([-1.0])]
    )
    loss.backward()
    assert stats["kl"] > 0 and float(lp.grad[0]) > 0  # new > ref: the penalty pushes the logprob down


def test_a_shared_prompt_is_run_once_with_the_same_logprobs_and_gradients(tmp_path):
    """GRPO groups share their prompt: the learner runs each distinct prompt once and the
    completions on its KV cache. Log-probabilities, entropy and every parameter's gradient
    equal running each sequence whole (prompts of different lengths, a temperature, an
    empty completion, groups out of order)."""
    import random

    from learner import grpo
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    rng = random.Random(0)
    groups = [[rng.randrange(3, 20) for _ in range(n)] for n in (30, 32, 31, 27)]
    prompts, completions = [], []
    for k in range(16):  # interleaved: group k % 4
        prompts.append(groups[k % 4])
        completions.append([rng.randrange(3, 20) for _ in range(0 if k == 5 else rng.randrange(1, 6))])
    temps = [0.7 if k % 2 else 1.0 for k in range(16)]
    weights = [rng.uniform(-1, 1) for _ in range(16)]
    results = {}
    for name, fn in (("whole", grpo.whole_sequence_logprobs), ("shared", grpo.completion_logprobs)):
        model.zero_grad()
        ent: list = []
        calls = []
        hook = model.register_forward_pre_hook(
            lambda m, args, kw, calls=calls: calls.append(kw["input_ids"].shape), with_kwargs=True
        )
        lp = fn(model, prompts, completions, tok.pad_token_id, ent, temps)
        hook.remove()
        sum((x * w).sum() for x, w in zip(lp, weights)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = ([x.detach() for x in lp], ent[0], grads, calls)
    (lw, ew, gw, cw), (ls, es, gs, cs) = results["whole"], results["shared"]
    assert [len(x) for x in ls] == [len(c) for c in completions]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(lw, ls))
    assert es == pytest.approx(ew, abs=1e-5)
    assert gw.keys() == gs.keys()
    for n in gw:
        assert torch.allclose(gw[n], gs[n], atol=1e-5, rtol=1e-4), n
    assert cw == [(16, max(len(p) + len(c) for p, c in zip(prompts, completions)))]  # every sequence whole
    assert cs == [(4, 32), (16, max(len(c) for c in completions))]  # the four prompts once, then the completions


def test_entropy_bonus_is_the_token_entropy_weighted_in_the_loss():
    cfg = LossConfig(objective="on_policy", entropy_coef=0.1)
    lp = [torch.zeros(1), torch.zeros(3)]
    ents = [torch.tensor([0.5]), torch.tensor([1.0, 2.0, 0.0])]
    masks = [torch.ones(1), torch.tensor([1.0, 1.0, 0.0])]
    base, _ = clipped_pg_loss(lp, lp, [1.0, -1.0], masks, LossConfig(objective="on_policy"))
    with_bonus, _ = clipped_pg_loss(lp, lp, [1.0, -1.0], masks, cfg, token_entropies=ents)
    assert float(with_bonus) == pytest.approx(float(base) - 0.1 * (0.5 + 1.0 + 2.0) / 3)  # masked token left out
    with pytest.raises(ValueError, match="entropy"):
        clipped_pg_loss(lp, lp, [1.0, -1.0], masks, cfg)


def test_token_entropies_agree_on_every_path_and_the_bonus_raises_entropy(tmp_path):
    """The per-token entropies (with gradient) from the padded, shared-prompt and packed
    paths are the same numbers, their mean is the reported entropy, and a step on the
    bonus alone (every advantage zero: no policy-gradient signal) raises the entropy."""
    from learner import grpo
    from learner.models import create_tiny_llama
    from learner.packing import packed_completion_logprobs
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [9, 10, 11]]
    completions = [[12, 13], [14], [15, 16, 17], []]
    temps = [1.0, 0.7, 1.0, 1.0]
    paths = {
        "whole": lambda te, ent: grpo.whole_sequence_logprobs(model, prompts, completions, tok.pad_token_id, ent, temps, te),
        "shared": lambda te, ent: grpo.completion_logprobs(model, prompts, completions, tok.pad_token_id, ent, temps, te),
        "packed": lambda te, ent: packed_completion_logprobs(
            model, prompts, completions, entropy=ent, temperatures=temps, token_entropies=te
        ),  # fmt: skip
    }
    got = {}
    for name, fn in paths.items():
        te, ent = [], []
        fn(te, ent)
        assert [len(x) for x in te] == [len(c) for c in completions], name
        assert all(x.requires_grad for x in te if len(x)), name
        assert float(torch.cat(te).detach().mean()) == pytest.approx(ent[0], abs=1e-5), name
        got[name] = torch.cat(te).detach()
    assert torch.allclose(got["whole"], got["shared"], atol=1e-5) and torch.allclose(got["whole"], got["packed"], atol=1e-5)

    cfg = LossConfig(objective="on_policy", entropy_coef=1.0)
    masks = [torch.ones(len(c)) for c in completions]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = float(got["whole"].mean())
    for _ in range(3):
        te = []
        lp = grpo.completion_logprobs(model, prompts, completions, tok.pad_token_id, None, temps, te)
        loss, _ = clipped_pg_loss(lp, [x.detach() for x in lp], [0.0] * 4, masks, cfg, token_entropies=te)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = []
    with torch.no_grad():
        grpo.completion_logprobs(model, prompts, completions, tok.pad_token_id, after, temps)
    assert after[0] > before + 1e-3, (before, after[0])


def test_an_empty_prompt_before_completion_tokens_is_refused_on_every_path(tmp_path):
    """A completion's first log-prob is read at its prompt's last position; an empty prompt has
    none, and the padded and packed paths would silently read another row's. Both refuse it,
    naming the sequence; an empty prompt with an empty completion has nothing to read."""
    from learner import grpo
    from learner.models import create_tiny_llama
    from learner.packing import packed_completion_logprobs
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    prompts, completions = [[5, 6, 7], [], [5, 6, 7]], [[8, 9], [10], [11]]
    with torch.no_grad():
        for run in (lambda: grpo.completion_logprobs(model, prompts, completions, tok.pad_token_id),  # a repeated prompt: shared path
                    lambda: grpo.completion_logprobs(model, prompts[:2], completions[:2], tok.pad_token_id),  # whole sequences
                    lambda: packed_completion_logprobs(model, prompts, completions)):  # fmt: skip
            with pytest.raises(ValueError, match="sequence 1: an empty prompt"):
                run()
        out = grpo.completion_logprobs(model, [[5, 6, 7], []], [[8], []], tok.pad_token_id)
        assert [len(t) for t in out] == [1, 0]


def test_importance_statistics_count_trained_tokens_only():
    """An observation token (loss mask 0, behaviour log-prob 0) is no importance weight: the
    statistics leave it out, so they do not move with how a batch divides into micro-batches."""
    new = [torch.tensor([-1.0, -3.0, -1.0]), torch.tensor([-2.0])]
    old = [torch.tensor([-1.5, 0.0, -1.0]), torch.tensor([-2.0])]
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.zeros(1)]
    _, stats = clipped_pg_loss(new, old, [1.0, 1.0], masks, LossConfig())
    e = float(torch.exp(torch.tensor(0.5)))
    assert stats["importance_mean"] == pytest.approx((e + 1.0) / 2) and stats["importance_max"] == pytest.approx(e)
    _, alone = clipped_pg_loss(new[1:], old[1:], [1.0], masks[1:], LossConfig())  # no trained token
    assert alone["importance_mean"] == 1.0 and alone["tokens"] == 0
