"""Ring attention and the context-parallel split, in one process: the kernel against SDPA with the
pack's mask (values and gradients), the balanced split, the log-prob path on a group of one, and
the start-up refusals that name ``learner.context_parallel``."""

from __future__ import annotations

import copy

import pytest
import torch

from conveyor.config import parse_run_config
from conveyor.errors import ConfigError
from learner import ring_attention
from learner.context_parallel import ContextGroup, split
from learner.ring_attention import RingAttention, RingLayout


def pack_layout(tokens: int = 50):
    """Two units (a prompt with two completions, a prompt with one) and padding of a unit of its own."""
    unit = torch.tensor([0] * 20 + [1] * 25 + [-1] * (tokens - 45))
    branch = torch.tensor([0] * 8 + [1] * 6 + [2] * 6 + [0] * 10 + [1] * 15 + [0] * (tokens - 45))
    idx = torch.arange(tokens)
    allowed = (unit[:, None] == unit[None]) & (idx[None] <= idx[:, None])
    allowed &= (branch[None] == 0) | (branch[None] == branch[:, None])
    return unit, branch, allowed


def attend(tile: int):
    torch.manual_seed(0)
    unit, branch, allowed = pack_layout()
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(1, heads, 50, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, 50, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, 50, dim, dtype=torch.float64, requires_grad=True)
    rep = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=allowed
    )
    out = RingAttention.apply(q, k, v, dim**-0.5, RingLayout(None, unit, branch, [torch.arange(50)], tile=tile))
    up = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), up)
    out_grads = torch.autograd.grad(out, (q, k, v), up)
    return float((out - ref).detach().abs().max()), max(float((a - b).abs().max()) for a, b in zip(ref_grads, out_grads))


@pytest.mark.parametrize("tile", [7, 16, 1024])
def test_tiled_kernel_equals_masked_sdpa(tile):
    value_diff, grad_diff = attend(tile)
    assert value_diff < 1e-12 and grad_diff < 1e-12, (value_diff, grad_diff)


def test_the_comparison_catches_a_kernel_without_document_masks(monkeypatch):
    def causal_only(layout, qr, kr, qa, ka):
        qpos, kpos = layout.meta[qr][0][qa : qa + layout.tile], layout.meta[kr][0][ka : ka + layout.tile]
        return kpos[None, :] <= qpos[:, None]

    monkeypatch.setattr(ring_attention, "_mask", causal_only)
    value_diff, _ = attend(7)
    assert value_diff > 1e-3


def test_split_balances_causal_work_and_pads_evenly():
    for tokens, size in ((64, 2), (61, 4), (1000, 4)):
        padded, local = split(tokens, size)
        assert padded % (2 * size) == 0 and padded - tokens < 2 * size
        assert sorted(torch.cat(local).tolist()) == list(range(padded))
        work = [int((pos + 1).sum()) for pos in local]  # keys each rank's queries see under a causal mask
        assert len(set(work)) == 1, work


def test_group_of_one_matches_the_packed_path(tmp_path):
    from learner.build import use_ring_attention
    from learner.models import create_tiny_llama
    from learner.packing import packed_completion_logprobs
    from tasks.suites.pyexpr import ALPHABET

    model, _ = create_tiny_llama(tmp_path, ALPHABET, seed=0, max_positions=128)
    ring = copy.deepcopy(model)
    use_ring_attention(ring)
    g = torch.Generator().manual_seed(1)
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 10, 11]] * 2 + [[12, 13, 14, 15, 16]]
    completions = [torch.randint(3, 30, (n,), generator=g).tolist() for n in (5, 3, 6, 2, 7, 4)]
    ref = packed_completion_logprobs(model, prompts, completions, pack_tokens=40)
    stats: dict = {}
    out = packed_completion_logprobs(ring, prompts, completions, pack_tokens=40, context=ContextGroup(None, 1, 0), stats=stats)
    assert max(float((a - b).abs().max()) for a, b in zip(ref, out)) < 1e-5
    sum(x.sum() for x in ref).backward()
    sum(x.sum() for x in out).backward()
    worst = max(float((a.grad - b.grad).abs().max() / a.grad.abs().max()) for a, b in zip(model.parameters(), ring.parameters()))
    assert worst < 1e-4, worst
    assert stats["cp_pad_tokens"] >= 1  # the 45 tokens of the first pack are padded to 46


def test_ring_attention_outside_the_learner_pass_is_refused():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="context-parallel log-prob pass"):
        ring_attention.ring_attention_forward(None, q, q, q, None)


@pytest.mark.parametrize(
    "learner, words",
    [
        ({"context_parallel": 2, "pack_tokens": 0}, "pack_tokens > 0"),
        ({"context_parallel": 2, "attn_implementation": "flash_attention_2"}, "flash_attention_2 cannot be split"),
        ({"context_parallel": 0}, "learner.context_parallel"),
    ],
)
def test_config_refuses_what_cannot_be_split(learner, words):
    with pytest.raises(ConfigError, match=words):
        parse_run_config({"learner": learner}, "test.yaml")


@pytest.mark.parametrize("world", ["1", "3"])
def test_context_parallel_must_divide_the_ranks(monkeypatch, world):
    from learner.distributed import RankGroup

    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ConfigError, match=f"learner.context_parallel: 2 must divide the learner's ranks, {world}"):
        RankGroup.from_env(2)


def test_a_sliding_window_model_is_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.build import use_ring_attention

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=0)  # fmt: skip
    with pytest.raises(ConfigError, match="learner.context_parallel: .*sliding-window"):
        use_ring_attention(Qwen2ForCausalLM(config))


def test_the_ranks_of_a_context_parallel_group_take_the_same_share():
    """2 data-parallel groups × 2 context-parallel ranks: ranks 0 and 1 run one half of the batch's
    packs, ranks 2 and 3 the other, in as many passes."""
    from conveyor.config import LearnerConfig
    from learner.distributed import RankGroup
    from learner.trainer import Trainer

    model = torch.nn.Linear(2, 2)
    config = LearnerConfig(pack_tokens=16, context_parallel=2)
    prompts = [[1, 2, 3]] * 4 + [[4, 5]] * 4 + [[6] * 9] * 2
    completions = [[7] * n for n in (3, 5, 2, 6, 4, 4, 1, 8, 3, 3)]
    passes = []
    for rank in range(4):
        ranks = RankGroup(rank, 4, None, ContextGroup(None, 2, rank % 2))
        assert (ranks.data_parallel, ranks.data_rank) == (2, rank // 2)
        passes.append(Trainer(model, 0, config, ranks=ranks).micro_batches(prompts, completions))
    assert passes[0] == passes[1] and passes[2] == passes[3] and len(passes[0]) == len(passes[2])
    mine = lambda p: sorted(i for part in p for i in part)  # noqa: E731
    assert sorted(mine(passes[0]) + mine(passes[2])) == list(range(10))


def test_a_trainer_refuses_ranks_started_with_another_group_size():
    from conveyor.config import LearnerConfig
    from learner.distributed import RankGroup
    from learner.trainer import Trainer

    with pytest.raises(ValueError, match="learner.context_parallel: 2"):
        Trainer(torch.nn.Linear(2, 2), 0, LearnerConfig(context_parallel=2), ranks=RankGroup(0, 2, None))
