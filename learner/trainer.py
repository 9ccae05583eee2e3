"""The learner's optimisation: a policy, its optimizer and schedule, and one step from prepared work.

``Trainer`` holds the model, AdamW, the warm-up schedule and, with ``kl_coef > 0``, a frozen copy
of the policy as it starts (the reference of the KL penalty). ``step(work)`` is one training step
on a batch the recipe prepared (``learner/preparation.py``: token ids, behaviour log-probabilities,
advantages, loss masks, temperatures); ``weights()``, ``state()`` and ``load(...)`` are what
publication and checkpoints read and write. The same class trains in the service's process, in
the child of ``learner/step_process.py`` and on every follower rank.

- A step is ``updates_per_batch`` optimizer updates on the batch (PPO's epochs, GRPO's mu). Every
  update clips against the same behaviour log-probabilities (and, for the decoupled objective,
  the same proximal ones, taken before the first update), so later updates stay within the clip
  range of the policy that sampled the batch. The statistics are the first update's (its
  importance weights measure the samples' staleness), with the last update's clip fraction and
  importance mean beside them. The learning-rate schedule advances once per step.
- Each update is a forward and backward over micro-batches (``micro_batch`` sequences at a time,
  0: all) whose gradients equal one pass over the whole batch: each part is normalised by the
  batch's totals. Sequences are packed (``pack_tokens``) or padded (0).
- Several ranks (``ranks``; ``learner/distributed.py``): the model is the FSDP2-sharded root.
  The trainer on rank 0 sends each collective operation (a step, a weights gather, a state
  gather, a load) to the other ranks before taking part in it; ``follow`` on every other rank
  runs the same operations as rank 0 commands. Each rank trains its token-balanced share of the
  sequences, one pack at a time, padded with empty passes to the largest pack count of any rank
  (FSDP gathers parameters and reduces gradients in every pass, so every rank runs as many).
  With context parallelism (``learner.context_parallel``; ``learner/context_parallel.py``) the
  shares go to data-parallel groups, and the ranks of a group run the same packs, each its part
  of every pack's tokens.
"""

from __future__ import annotations

import copy
import math

import torch

from conveyor.config import LearnerConfig
from learner.distributed import (
    RankGroup,
    full_model_state,
    full_optimizer_state,
    load_full_state,
    load_sharded_state,
    sharded_model_state,
    sharded_optimizer_state,
    split_by_tokens,
)
from learner.grpo import LossConfig, clipped_pg_loss, completion_logprobs
from learner.packing import LogprobHead, pack_sequences, packed_completion_logprobs, shares_prompts
from learner.vision import vision_logprobs


def hf_model(model):
    """The Hugging Face model inside ``model`` (on several ranks a ``LogprobHead`` wraps it): state dicts are its."""
    return model.model if isinstance(model, LogprobHead) else model


def is_adapter_model(hf) -> bool:
    """A PEFT model (``learner.lora``): its published weights are the adapter alone."""
    return hasattr(hf, "peft_config")


def gather_weights(hf) -> dict:
    """The policy's tensors as a Hugging Face checkpoint stores them (a tied LM head once),
    gathered from every rank's shards on several ranks (collective: every rank calls it). For a
    LoRA policy, the adapter's tensors under PEFT's names (conveyor/adapters.py)."""
    if is_adapter_model(hf):
        from peft import get_peft_model_state_dict

        return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(hf).items()}
    state = full_model_state(hf)
    if getattr(getattr(hf, "config", None), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().contiguous() for k, v in state.items()}


def detached(hf, state: dict) -> dict:
    """``state`` on the CPU, sharing no storage with ``hf``: tensors that are its live parameters
    are copied (gathered ones, on several ranks, are copies already)."""
    live = {t.data_ptr() for t in (*hf.parameters(), *hf.buffers())}
    return {k: v.to("cpu", copy=v.data_ptr() in live) for k, v in state.items()}


def copy_weights(hf, weights: bytes) -> None:
    """Copy safetensors weights (as ``gather_weights`` gives them) into ``hf``'s live tensors
    (a tied LM head follows the embedding it shares storage with)."""
    from safetensors.torch import load

    if is_adapter_model(hf):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(hf, load(weights))
        return
    live = hf.state_dict()
    with torch.no_grad():
        for name, tensor in load(weights).items():
            live[name].copy_(tensor)


class Trainer:
    """The policy's training state and its optimisation step (see the module's docstring)."""

    def __init__(self, model, pad_id: int, config: LearnerConfig, *, ranks: RankGroup | None = None, vision=None,
                 store=None) -> None:  # fmt: skip
        if vision is not None and ranks is not None:
            raise ValueError("a vision-language model trains on one process (learner ranks: 1)")
        if ranks is not None:
            if config.kl_coef > 0:
                raise ValueError("learner.kl_coef > 0 is not supported on several ranks (the frozen reference is not sharded)")
            if config.pack_tokens <= 0:
                raise ValueError("learner.pack_tokens must be > 0 on several ranks (each rank trains its packs)")
        if config.context_parallel != (ranks.context.size if ranks is not None else 1):
            raise ValueError(f"learner.context_parallel: {config.context_parallel}, but the ranks were started with "
                             f"{ranks.context.size if ranks is not None else 1} per context-parallel group")  # fmt: skip
        self.model = model
        self.hf = hf_model(model)
        self.pad_id = pad_id
        self.config = config
        self.loss = LossConfig.of(config)
        self.ranks = ranks
        self.store = store  # where each rank writes and reads its shards of a sharded checkpoint
        self.vision = vision  # a vision-language model's conveyor.vision.VisionPrompting: sequences run whole, with pixels
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
        warm = max(1, config.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / warm))
        self.reference = None  # the KL penalty's reference: the policy as it starts, frozen
        if self.loss.kl_coef > 0 and not is_adapter_model(self.hf):
            self.reference = copy.deepcopy(model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        # A LoRA policy's start is its base model (PEFT's B starts at zero): the reference is the
        # policy with its adapter switched off, so the penalty costs no second copy of the model.
        self._stopped = False

    # ------------------------------------------------- collective operations
    def _command(self, op: str, payload=None) -> None:
        """On rank 0 of several ranks: have every other rank run ``op`` with this one."""
        if self.ranks is not None and self.ranks.leader:
            self.ranks.command(op, payload)

    def step(self, work: dict) -> dict:
        """One training step on ``work`` (``learner/preparation.py``); its statistics."""
        self._command("step", work)
        return self._optimise(work)

    def weights(self) -> dict:
        """The policy's tensors as a Hugging Face checkpoint stores them (``gather_weights``)."""
        self._command("weights")
        return gather_weights(self.hf)

    def snapshot(self) -> dict:
        """A CPU copy of ``weights()`` that later steps do not change."""
        return detached(self.hf, self.weights())

    def state(self) -> tuple[dict, dict, dict]:
        """Full, FQN-keyed model and optimizer state and the scheduler's (gathered from every rank:
        a checkpoint written by N ranks resumes on M)."""
        self._command("state")
        return (*self._gather_state(), self.scheduler.state_dict())

    def load(self, model_state: dict, optimizer_state: dict, scheduler_state: dict, *, fqn_keyed: bool = True) -> None:
        """Continue from a checkpoint's state (``state()``'s; on several ranks rank 0's, broadcast).
        ``fqn_keyed=False``: plain ``state_dict()``s of one process (checkpoints from before
        checkpoints were FQN-keyed)."""
        if not fqn_keyed:
            if self.ranks is not None:
                raise RuntimeError("this checkpoint predates multi-rank checkpoints: resume it on one process")
            self.model.load_state_dict(model_state)
            self.optimizer.load_state_dict(optimizer_state)
            self.scheduler.load_state_dict(scheduler_state)
            return
        self._command("load", scheduler_state)
        self._load_full(model_state, optimizer_state, scheduler_state)

    def sharded_state(self, run_id: str, step: int) -> tuple[dict, list[dict]]:
        """A sharded checkpoint's model and optimizer state: the tree (a mark in place of each
        sharded tensor) and every rank's shard reference; each rank writes its own (collective)."""
        self._command("save_shards", (run_id, step))
        return self._save_shards(run_id, step)

    def load_sharded(self, tree: dict, shards: list[dict], scheduler_state: dict, run_id: str, where: str) -> None:
        """Continue from a sharded checkpoint: each rank reads the pieces of its own share (collective)."""
        self._command("load_shards", (tree, shards, scheduler_state, run_id, where))
        self._load_shards(tree, shards, scheduler_state, run_id, where)

    def follow(self) -> None:
        """On a rank other than 0: take part in every collective operation rank 0 runs (steps,
        weights gathers, state gathers, loads) until it says stop."""
        if self.ranks is None or self.ranks.leader:
            raise RuntimeError("only a rank other than 0 follows")
        while True:
            op, payload = self.ranks.command()
            if op == "step":
                self._optimise(payload)
            elif op == "weights":
                gather_weights(self.hf)
            elif op == "state":
                self._gather_state()
            elif op == "load":
                self._load_full({}, {}, payload)
            elif op == "save_shards":
                self._save_shards(*payload)  # type: ignore[misc]
            elif op == "load_shards":
                self._load_shards(*payload)  # type: ignore[misc]
            elif op == "stop":
                return
            else:
                raise RuntimeError(f"unknown learner command {op!r}")

    def close(self) -> None:
        """On rank 0 of several ranks: tell the followers to stop (once)."""
        if not self._stopped:
            self._stopped = True
            self._command("stop")

    def _gather_state(self) -> tuple[dict, dict]:
        """Full, FQN-keyed model and optimizer state (collective: every rank calls it, in this order)."""
        return full_model_state(self.hf), full_optimizer_state(self.hf, self.optimizer)

    def _save_shards(self, run_id: str, step: int) -> tuple[dict, list[dict]]:
        from learner.sharded_checkpoint import split, write_shard

        assert self.ranks is not None and self.store is not None, "a sharded checkpoint is written by several ranks"
        state = {"model": sharded_model_state(self.hf), "optimizer": sharded_optimizer_state(self.hf, self.optimizer)}
        tree, pieces, index = split(state, self.ranks.rank)
        ref = write_shard(self.store, run_id, step, self.ranks.rank, pieces)
        return tree, self.ranks.gather({**ref, "pieces": index})

    def _load_shards(self, tree: dict, shards: list[dict], scheduler_state: dict, run_id: str, where: str) -> None:
        from learner.sharded_checkpoint import fill, named_leaves

        now = named_leaves({"model": sharded_model_state(self.hf), "optimizer": sharded_optimizer_state(self.hf, self.optimizer)})
        state = fill(tree, shards, self.store, run_id, template=now.get, where=where)  # type: ignore[arg-type]
        load_sharded_state(self.hf, self.optimizer, state["model"], state["optimizer"])
        self.scheduler.load_state_dict(scheduler_state)

    def _load_full(self, model_state: dict, optimizer_state: dict, scheduler_state: dict) -> None:
        load_full_state(self.hf, self.optimizer, model_state, optimizer_state)  # rank 0's, broadcast
        self.scheduler.load_state_dict(scheduler_state)

    # ------------------------------------------------------------- the step
    def _optimise(self, work: dict) -> dict:
        """``updates_per_batch`` optimizer updates on the step's sequences, then one step of the
        schedule (on several ranks every rank runs them on the same ``work`` and trains its share)."""
        updates = self.config.updates_per_batch
        prox_cache: list = []
        skipped = 0
        for update in range(updates):
            loss, stats = self.accumulate(**work, prox_cache=prox_cache)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            if hasattr(grad_norm, "full_tensor"):  # sharded gradients: the norm is a replicated DTensor
                grad_norm = grad_norm.full_tensor()
            if math.isfinite(float(grad_norm)) and math.isfinite(loss):
                self.optimizer.step()
            else:
                # One NaN update poisons the weights for good, and every rollout worker that loads
                # them: the update is dropped (every rank sees the same replicated norm) and counted.
                self.optimizer.zero_grad(set_to_none=True)
                skipped += 1
            if update == 0:
                first = dict(stats, loss=loss, grad_norm=float(grad_norm), lr=self.scheduler.get_last_lr()[0])
        first["nonfinite_updates_skipped"] = skipped
        self.scheduler.step()
        if updates > 1:
            first.update(
                updates=updates, last_clip_fraction=stats["clip_fraction"], last_importance_mean=stats["importance_mean"]
            )
        return first

    def micro_batches(self, prompts, completions) -> list[list[int]]:
        """Sequence indices of each forward/backward pass this process runs.

        One process: ``micro_batch`` sequences at a time (0: all). Several ranks: this rank's
        share (token-balanced) one pack at a time, then empty passes up to the largest pack
        count of any rank: FSDP gathers parameters and reduces gradients in every pass, so every
        rank must run the same number."""
        n = len(prompts)
        if self.ranks is None:
            size = self.config.micro_batch or n
            return [list(range(lo, min(lo + size, n))) for lo in range(0, n, size)]
        per_rank = []  # per data-parallel group: the ranks of a context-parallel group run the same packs
        for share in split_by_tokens([len(p) + len(c) for p, c in zip(prompts, completions)], self.ranks.data_parallel):
            packs = pack_sequences([prompts[i] for i in share], [completions[i] for i in share], self.config.pack_tokens,
                                   share_prompts=shares_prompts(self.model))  # fmt: skip
            per_rank.append([[share[i] for i, *_ in pack.spans] for pack in packs])
        passes = max(len(r) for r in per_rank)
        mine = per_rank[self.ranks.data_rank]
        return mine + [[] for _ in range(passes - len(mine))]

    def logprobs(self, prompts, completions, temps, entropy=None, token_entropies=None, stats=None, images=None,
                 model=None) -> list[torch.Tensor]:  # fmt: skip
        """The completion tokens' log-probabilities under the policy (packed or padded; bf16 matmuls
        and fp32 log-softmax on a GPU; with context parallelism, every pack split over the group;
        a vision-language model's sequences whole, with their ``images``). ``model``: a vision-language
        KL reference instead of the policy."""
        device_type = next(self.model.parameters()).device.type
        pack_tokens = self.config.pack_tokens
        context = self.ranks.context if self.ranks is not None and self.ranks.context.size > 1 else None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device_type == "cuda"):
            if self.vision is not None:
                return vision_logprobs(model or self.model, self.vision, prompts, completions, images, self.pad_id,
                                       entropy, temps, token_entropies)  # fmt: skip
            if pack_tokens:
                return packed_completion_logprobs(self.model, prompts, completions, pack_tokens=pack_tokens,
                                                  entropy=entropy, temperatures=temps, token_entropies=token_entropies,
                                                  context=context, stats=stats)  # fmt: skip
            return completion_logprobs(self.model, prompts, completions, self.pad_id, entropy=entropy, temperatures=temps,
                                       token_entropies=token_entropies)  # fmt: skip

    def accumulate(
        self,
        prompts,
        completions,
        behaviour,
        advantages,
        masks,
        fresh=None,
        temps=None,
        prox_cache: list | None = None,
        images=None,
    ) -> tuple[float, dict]:
        """Forward and backward over ``micro_batches``; the gradients equal one pass over the whole
        batch (each part is normalised by the batch's totals; on several ranks each part is scaled
        by the number of data-parallel groups: FSDP averages gradients over all ranks, and a
        context-parallel group's ranks, each computing the whole part's loss from the gathered
        log-probabilities, give that part's gradient times the group's size between them).

        ``fresh[i]``: sample i was generated by exactly the current weights, so the gap between
        its behaviour logprobs and the learner's is the train/inference mismatch (engine numerics,
        kernels, precision), reported as ``logprob_mismatch_mean/max``. ``temps[i]``: sample i's
        sampling temperature; every log-probability is taken under ``softmax(logits / T)``, the
        distribution the behaviour logprobs are of. ``prox_cache``: the decoupled objective's
        proximal log-probabilities per micro-batch, filled by the first call and reused by later
        ones on the same batch (the proximal policy is the one before the step's first update)."""
        n = len(prompts)
        cfg = self.loss
        # FSDP averages gradients over every rank; a context-parallel group's ranks share one part of the batch
        ways = self.ranks.data_parallel if self.ranks is not None else 1
        device = next(self.model.parameters()).device
        behaviour = [b.to(device) for b in behaviour]
        masks = [m.to(device) for m in masks]
        agg_tokens = float(sum(float(m.sum()) for m in masks))
        denominator = agg_tokens if cfg.aggregation == "token" else float(n)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, parts, entropies, cp_stats = 0.0, [], [], {"cp_pad_tokens": 0}
        mismatch = [0.0, 0, 0.0]  # sum, tokens, max
        for part, idx in enumerate(self.micro_batches(prompts, completions)):
            if not idx:  # this rank has no pack left: a pass that contributes nothing joins the collectives
                idx, zero = [0], True
            else:
                zero = False
            pick = lambda xs, idx=idx: [xs[i] for i in idx]  # noqa: E731
            p, c = pick(prompts), pick(completions)
            t = pick(temps) if temps else None
            im = pick(images) if images else None
            prox = ref = None
            if cfg.objective == "decoupled":
                if prox_cache is not None and part < len(prox_cache):
                    prox = prox_cache[part]  # a later update on this batch: the step's proximal policy
                else:
                    with torch.no_grad():  # the proximal policy: current weights, before this step's updates
                        self.model.eval()
                        prox = [x.float() for x in self.logprobs(p, c, t, images=im)]
                    if prox_cache is not None:
                        prox_cache.append(prox)
            if cfg.kl_coef > 0:
                with torch.no_grad():
                    if self.vision is not None:
                        ref = self.logprobs(p, c, t, images=im, model=self.reference)
                    elif self.reference is None:  # LoRA: the base model, the adapter off
                        self.model.eval()
                        with self.hf.disable_adapter():
                            ref = completion_logprobs(self.model, p, c, self.pad_id, temperatures=t)
                    else:
                        ref = completion_logprobs(self.reference, p, c, self.pad_id, temperatures=t)
            self.model.train()
            ent: list[float] = []
            tok_ents = [] if cfg.entropy_coef > 0 else None  # per-token entropies for the bonus
            new = [x.float() for x in self.logprobs(p, c, t, ent, tok_ents, cp_stats, images=im)]
            if zero:
                (sum(x.sum() for x in new) * 0.0).backward()
                continue
            for j, i in enumerate(idx):
                if fresh and fresh[i]:
                    gap = (new[j].detach() - behaviour[i]).abs()[masks[i] > 0]
                    if gap.numel():
                        mismatch[0] += float(gap.sum())
                        mismatch[1] += gap.numel()
                        mismatch[2] = max(mismatch[2], float(gap.max()))
            loss, st = clipped_pg_loss(new, pick(behaviour), pick(advantages), pick(masks), cfg, prox, ref, denominator,
                                       tok_ents)  # fmt: skip
            (loss * ways).backward()
            total_loss += float(loss.detach())
            parts.append(st)
            entropies.append(ent[0])
        if self.ranks is not None:  # every data-parallel group's statistics (its context-parallel ranks agree), merged
            gathered = self.ranks.gather((total_loss, parts, entropies, mismatch, cp_stats))[:: self.ranks.context.size]
            cp_stats["cp_pad_tokens"] = sum(g[4]["cp_pad_tokens"] for g in gathered)
            total_loss = sum(g[0] for g in gathered)
            parts = [st for g in gathered for st in g[1]]
            entropies = [e for g in gathered for e in g[2]]
            mismatch = [sum(g[3][0] for g in gathered), sum(g[3][1] for g in gathered), max(g[3][2] for g in gathered)]
        tokens = sum(st["tokens"] for st in parts)
        weighted = lambda k: sum(st[k] * st["tokens"] for st in parts) / max(tokens, 1)  # noqa: E731
        stats = {
            "importance_mean": weighted("importance_mean"),
            "importance_max": max(st["importance_max"] for st in parts),
            "clip_fraction": weighted("clip_fraction"),
            "tokens": tokens,
            "entropy": sum(entropies) / len(entropies),
            "micro_batches": len(parts),
        }
        if mismatch[1]:
            stats.update(logprob_mismatch_mean=mismatch[0] / mismatch[1], logprob_mismatch_max=mismatch[2],
                         logprob_mismatch_tokens=mismatch[1])  # fmt: skip
        if self.ranks is not None and self.ranks.context.size > 1:
            stats["cp_pad_tokens"] = cp_stats["cp_pad_tokens"]
        if any("kl" in st for st in parts):
            stats["kl"] = weighted("kl")
        return total_loss, stats
