"""Run by tests/integration/test_sharded_checkpoint.py, under torchrun or alone: a learner's
Trainer (FSDP2 on gloo ranks) that trains two steps and writes a sharded checkpoint (``save``), or
resumes from one (``load``); rank 0 then writes the gathered full state to ``OUT`` for comparison.

    python sharded_checkpoint_ranks.py save|load MODEL_DIR STORE_DIR OUT
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RUN = "sharded"


def _steps(trainer, tok) -> None:
    """Two optimizer updates on fixed sequences (every rank the same), so AdamW has moments."""
    from learner.packing import packed_completion_logprobs

    prompts = [tok("a = 1\nassert a ==", add_special_tokens=False).input_ids] * 2
    completions = [tok(" 1\n", add_special_tokens=False).input_ids, tok(" 2\n", add_special_tokens=False).input_ids]
    for _ in range(2):
        lp = packed_completion_logprobs(trainer.model, prompts, completions, pack_tokens=64)
        loss = -(lp[0].sum() - lp[1].sum())
        trainer.optimizer.zero_grad()
        loss.backward()
        trainer.optimizer.step()


def _flat(model_state: dict, optimizer_state: dict) -> dict:
    out = {f"model/{k}": v for k, v in model_state.items()}
    for fqn, slots in optimizer_state["state"].items():
        out.update({f"optimizer/{fqn}/{k}": v.reshape(-1) if v.dim() == 0 else v for k, v in slots.items()})
    return {k: v.detach().cpu().clone() for k, v in out.items()}  # clones: the tied LM head is the embedding


def main(mode: str, model_dir: str, store_dir: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file

    from conveyor.config import RunConfig
    from conveyor.objectstore import LocalObjectStore
    from learner.build import load_policy
    from learner.checkpoint import restore_checkpoint, write_checkpoint
    from learner.distributed import RankGroup
    from learner.trainer import Trainer

    torch.set_num_threads(1)
    ranks = RankGroup.from_env()
    cfg = RunConfig(learner={"pack_tokens": 64, "checkpoint_layout": "sharded", "lr": 1e-2})
    policy, tok = load_policy(Path(model_dir), cfg, ranks)
    store = LocalObjectStore(store_dir)
    trainer = Trainer(policy, tok.pad_token_id, cfg.learner, ranks=ranks, store=store)
    if mode == "save":
        _steps(trainer, tok)
    if ranks is not None and not ranks.leader:
        trainer.follow()
        ranks.close()
        return
    if mode == "save":
        asyncio.run(write_checkpoint(store, RUN, trainer, {"step": 3}, step=3, keep=2))
    else:
        assert restore_checkpoint(store, RUN, trainer) is not None
    model_state, optimizer_state, _ = trainer.state()
    save_file(_flat(model_state, optimizer_state), out)
    trainer.close()
    if ranks is not None:
        ranks.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
