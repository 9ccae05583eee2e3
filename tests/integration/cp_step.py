"""Run under torchrun (gloo, CPU) with ``learner.context_parallel`` = argv[2]: one GRPO step's loss,
statistics, per-token log-probs and gradients on packs of several documents, written by rank 0.
One process (argv[2] = 1, no torchrun) is the reference: every pack whole, SDPA with its mask."""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def batch():
    """Groups of samples sharing a prompt (tree packs), of uneven lengths, some sampled at T != 1."""
    g = torch.Generator().manual_seed(1)
    prompts, completions, temps = [], [], []
    for group, (plen, size) in enumerate([(9, 3), (5, 4), (13, 2), (7, 3), (4, 2)]):
        prompt = torch.randint(3, 30, (plen,), generator=g).tolist()
        for _ in range(size):
            prompts.append(prompt)
            completions.append(torch.randint(3, 30, (int(torch.randint(2, 17, (1,), generator=g)),), generator=g).tolist())
            temps.append(0.7 if group % 2 else 1.0)
    n = len(prompts)
    behaviour = [-torch.rand(len(c), generator=g) - 1.0 for c in completions]
    advantages = [float(x) for x in torch.randn(n, generator=g)]
    masks = [(torch.rand(len(c), generator=g) > 0.2).float() for c in completions]
    return prompts, completions, behaviour, advantages, masks, [True] * n, temps


def main(out_path: str, context_parallel: int) -> None:
    from conveyor.config import LearnerConfig
    from learner.build import use_ring_attention
    from learner.distributed import RankGroup, shard
    from learner.models import create_tiny_llama
    from learner.trainer import Trainer
    from tasks.suites.pyexpr import ALPHABET

    torch.manual_seed(0)
    ranks = RankGroup.from_env(context_parallel)
    model, tok = create_tiny_llama(tempfile.mkdtemp(), ALPHABET, seed=0, max_positions=256)
    config = LearnerConfig(pack_tokens=96, context_parallel=context_parallel, entropy_coef=0.01)
    if ranks is not None:
        if context_parallel > 1:
            use_ring_attention(model)
        model = shard(model)
    trainer = Trainer(model, tok.pad_token_id, config, ranks=ranks)
    prompts, completions, behaviour, advantages, masks, fresh, temps = batch()
    loss, stats = trainer.accumulate(prompts, completions, behaviour, advantages, masks, fresh, temps)
    grads = {}
    for name, p in trainer.hf.named_parameters():
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = full.flatten().tolist()
    with torch.no_grad():
        logprobs = [x.tolist() for x in trainer.logprobs(prompts, completions, temps)]
    if ranks is None or ranks.leader:
        with open(out_path, "w") as fh:
            json.dump({"loss": loss, "stats": stats, "grads": grads, "logprobs": logprobs}, fh)
    if ranks is not None:
        dist.barrier()
        ranks.close()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(sys.argv[1], int(sys.argv[2]))
