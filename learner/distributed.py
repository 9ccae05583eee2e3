"""Multi-process training with FSDP2 (``torch.distributed.fsdp.fully_shard``).

``shard`` wraps every decoder layer and then the root, so parameters,
gradients and optimizer state are split across ranks and gathered one layer
at a time. Runs under ``torchrun`` with NCCL on GPUs and with gloo on CPU
(that is how ``tests/integration/test_fsdp.py`` checks it: 2 CPU processes
give the same loss and gradients as 1).

``grpo_step_gradients`` is the learner's loss on a rank's share of a batch
(sequences ``rank::world``), used by that test and by ``bench/learner_gpu.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard(model, *, mixed_precision: bool = False):
    """FSDP2-shard a causal LM for the packed log-prob path; returns the root module to train
    (a ``LogprobHead`` around ``model``: embeddings, final norm and a tied LM head stay in
    the root unit, gathered around its forward)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from learner.packing import LogprobHead

    kwargs = {}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = LogprobHead(model)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    return root


def rank_share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def grpo_loss_on_share(model, prompts, completions, behaviour, advantages, masks, cfg, *, pack_tokens: int = 4096):
    """The GRPO loss of this rank's share; with equal token counts per rank the mean over
    ranks (FSDP averages gradients) equals the single-process loss on the whole batch."""
    from learner.grpo import clipped_pg_loss
    from learner.packing import packed_completion_logprobs

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    take = lambda xs: rank_share(xs, rank, world)  # noqa: E731
    new = packed_completion_logprobs(model, take(prompts), take(completions), pack_tokens=pack_tokens)
    loss, stats = clipped_pg_loss(new, take(behaviour), take(advantages), take(masks), cfg)
    return loss, stats
