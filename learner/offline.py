"""Offline post-training from the trajectory lake.

- **Rejection-sampling SFT** (:func:`rejection_sampling_sft`): train on the
  passing trajectories of a run (``verdict == pass``), one copy per distinct
  (prompt, completion), negative log-likelihood of completion tokens only.
- **DPO** (:func:`dpo_pairs`, :func:`train_dpo`): pairs are built inside
  groups (same task): every higher-reward completion is *chosen* against
  every lower-reward one, capped per group; the loss is
  ``-log σ(β·[(log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r))])`` with
  sequence log-probabilities summed over completion tokens and a frozen
  copy of the starting model as the reference.

Both read the lake through :class:`storage.lake.LakeReader`, so the data is
exactly what the online run produced (token ids, not re-tokenised text). The
CLI hands them :func:`samples_from_tables` over the reader's Arrow tables:
the five columns they use, with no ``ScoredRollout`` built per row.
"""

from __future__ import annotations

import copy
import random
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from conveyor.contracts import ScoredRollout
from learner.grpo import completion_logprobs


@dataclass(frozen=True)
class Pair:
    task_id: str
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    margin: float  # reward(chosen) - reward(rejected)


@dataclass(frozen=True)
class Sample:
    """What the offline recipes read of a lake row."""

    task_id: str
    verdict: str
    reward: float
    prompt: list[int]
    completion: list[int]


def samples_from_tables(tables: Iterable) -> Iterator[Sample]:
    """The samples of the lake reader's Arrow tables (``LakeReader.iter_tables``), column by column."""
    names = ["task_id", "verdict", "reward", "prompt_token_ids", "completion_token_ids"]
    for table in tables:
        cols = table.select(names).to_pydict()
        yield from (Sample(*row) for row in zip(*(cols[n] for n in names), strict=True))


def _sample(s: ScoredRollout | Sample) -> Sample:
    if isinstance(s, Sample):
        return s
    r = s.rollout
    return Sample(r.task_id, s.verdict, s.reward, r.prompt_token_ids.tolist(), r.completion_token_ids.tolist())


def passing_examples(rows: Iterable[ScoredRollout | Sample]) -> list[tuple[list[int], list[int]]]:
    seen, out = set(), []
    for s in map(_sample, rows):
        if s.verdict != "pass":
            continue
        ex = (tuple(s.prompt), tuple(s.completion))
        if ex not in seen:
            seen.add(ex)
            out.append((list(ex[0]), list(ex[1])))
    return out


def dpo_pairs(rows: Iterable[ScoredRollout | Sample], max_pairs_per_group: int = 4, seed: int = 0) -> list[Pair]:
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in map(_sample, rows):
        if s.verdict != "infra":
            groups[s.task_id].append(s)
    rng = random.Random(seed)
    pairs = []
    for task_id in sorted(groups):
        group = groups[task_id]
        cands = [
            Pair(task_id, a.prompt, a.completion, b.completion, a.reward - b.reward)
            for a in group
            for b in group
            if a.reward > b.reward and a.completion != b.completion
        ]
        rng.shuffle(cands)
        pairs.extend(cands[:max_pairs_per_group])
    return pairs


def _batches(items: list, size: int, rng: random.Random) -> Iterable[list]:
    order = list(range(len(items)))
    rng.shuffle(order)
    for i in range(0, len(order), size):
        yield [items[j] for j in order[i : i + size]]


def rejection_sampling_sft(
    model, rows: Iterable[ScoredRollout | Sample], pad_id: int, *, epochs: int = 1, batch_size: int = 32, lr: float = 1e-4, seed: int = 0,
    on_step=None,
) -> dict:  # fmt: skip
    """``on_step(1, status=...)`` after each optimizer step (the CLI's progress)."""
    from learner.demonstrations import train_sft

    examples = passing_examples(rows)
    if not examples:
        raise ValueError("no passing trajectories to train on")
    return train_sft(model, examples, pad_id, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, on_step=on_step)


def _seq_logps(model, prompts, completions, pad_id) -> torch.Tensor:
    return torch.stack([lp.sum() for lp in completion_logprobs(model, prompts, completions, pad_id)])


def dpo_loss(pc, pr, rc, rr, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    margin = beta * ((pc - rc) - (pr - rr))
    loss = -torch.nn.functional.logsigmoid(margin).mean()
    m = margin.detach()
    return loss, {"reward_margin": float(m.mean() / beta), "accuracy": float((m > 0).float().mean())}


def train_dpo(
    model,
    pairs: list[Pair],
    pad_id: int,
    *,
    epochs: int = 1,
    batch_size: int = 16,
    lr: float = 5e-5,
    beta: float = 0.1,
    seed: int = 0,
    on_step=None,
) -> dict:
    """``on_step(1, status=...)`` after each optimizer step (the CLI's progress)."""
    if not pairs:
        raise ValueError("no preference pairs (no group had different rewards)")
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    history = []
    for _ in range(epochs):
        for batch in _batches(pairs, batch_size, rng):
            prompts = [p.prompt for p in batch]
            with torch.no_grad():
                rc = _seq_logps(ref, prompts, [p.chosen for p in batch], pad_id)
                rr = _seq_logps(ref, prompts, [p.rejected for p in batch], pad_id)
            model.train()
            pc = _seq_logps(model, prompts, [p.chosen for p in batch], pad_id)
            pr = _seq_logps(model, prompts, [p.rejected for p in batch], pad_id)
            loss, stats = dpo_loss(pc, pr, rc, rr, beta)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            history.append({"loss": float(loss.detach()), **stats})
            if on_step is not None:
                on_step(1, status=f"loss {history[-1]['loss']:.3f}, accuracy {stats['accuracy']:.2f}")
    return {
        "pairs": len(pairs),
        "steps": len(history),
        "loss_first": history[0]["loss"],
        "loss_last": history[-1]["loss"],
        "reward_margin_last": history[-1]["reward_margin"],
        "accuracy_last": history[-1]["accuracy"],
    }
