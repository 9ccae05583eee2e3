"""Gradient accumulation over micro-batches gives the gradients of one pass over the batch."""

from __future__ import annotations

import copy

import pytest
import torch

from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from learner.grpo import LossConfig
from learner.recipe import GRPOLearner
from storage.objectstore import LocalObjectStore


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("objective", ["behaviour", "decoupled"])
def test_micro_batches_match_one_batch(tmp_path, aggregation, objective):
    from learner.models import create_tiny_llama
    from producers.suites.pyexpr import ALPHABET

    torch.manual_seed(0)
    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    g = torch.Generator().manual_seed(3)
    n = 6
    prompts = [torch.randint(3, 30, (4 + i % 3,), generator=g).tolist() for i in range(n)]
    completions = [torch.randint(3, 30, (2 + i % 4,), generator=g).tolist() for i in range(n)]
    behaviour = [-torch.rand(len(c), generator=g) - 0.5 for c in completions]
    masks = [torch.ones(len(c)) for c in completions]
    advantages = [float(x) for x in torch.randn(n, generator=g)]
    grads = []
    for micro in (0, 2):
        m = copy.deepcopy(model)
        lrn = GRPOLearner(MemoryTransport(), Topics("r"), m, tok.pad_token_id, LocalObjectStore(tmp_path / "o"), run_dir=tmp_path,
                          loss=LossConfig(aggregation=aggregation, objective=objective), micro_batch=micro)  # fmt: skip
        loss, stats = lrn._accumulate(prompts, completions, behaviour, advantages, masks)
        grads.append(({k: p.grad.clone() for k, p in m.named_parameters()}, loss, stats))
    (g_full, loss_full, s_full), (g_micro, loss_micro, s_micro) = grads
    assert s_micro["micro_batches"] == 3 and s_full["micro_batches"] == 1
    assert loss_micro == pytest.approx(loss_full, abs=1e-5)
    for k in g_full:
        assert torch.allclose(g_full[k], g_micro[k], atol=1e-6), k
