"""Run under torchrun (gloo, CPU): one GRPO step's loss and gradients, written by rank 0."""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from learner.distributed import grpo_loss_on_share, shard
    from learner.grpo import LossConfig
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    torch.manual_seed(0)
    model, _ = create_tiny_llama(tempfile.mkdtemp(), ALPHABET, seed=0)
    from learner.packing import LogprobHead

    model = shard(model) if world > 1 else LogprobHead(model)
    g = torch.Generator().manual_seed(1)
    n = 8
    prompts = [torch.randint(3, 30, (6,), generator=g).tolist() for _ in range(n)]
    completions = [torch.randint(3, 30, (5,), generator=g).tolist() for _ in range(n)]
    behaviour = [-torch.rand(5, generator=g) - 1.0 for _ in range(n)]
    advantages = [float(x) for x in torch.randn(n, generator=g)]
    masks = [torch.ones(5) for _ in range(n)]
    loss, _ = grpo_loss_on_share(model, prompts, completions, behaviour, advantages, masks, LossConfig(), pack_tokens=64)
    loss.backward()
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
        total /= world
    grads = {}
    for name, p in model.named_parameters():
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = full.flatten().tolist()
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump({"world": world, "loss": float(total), "grads": grads}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(sys.argv[1])
