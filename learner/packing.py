"""Sequence packing and a memory-bounded log-prob computation.

Packing: sequences (prompt + completion) are laid end to end into packs of
at most ``pack_tokens`` tokens (first fit, in order), with position ids
restarting at 0 for every prompt, so no token is spent on padding. A prompt
that several sequences share (a GRPO group's samples) is laid down once,
followed by each of its completions at the positions after it (a tree):
a group of ``n`` samples of a ``P``-token prompt costs ``(n - 1) * P`` fewer
tokens. Attention must not cross sequences:

- with PyTorch SDPA (the default here), a pack holding one sequence uses
  the causal kernel (no mask: memory linear in its length); a pack holding
  several gets a boolean mask (causal, within a prompt's unit, and a
  completion sees its prompt and itself but not its siblings),
  ``pack_tokens²`` booleans — bounded by the pack size, not by the batch;
- with flash-attn installed (``attn_implementation="flash_attention_2"``),
  transformers detects the restarting position ids and calls the varlen
  kernel (memory linear in the pack), which cannot express the tree: every
  sequence is laid down whole, prompt included;
- with FlexAttention (``attn_implementation="flex_attention"``), the same
  rule as the boolean mask is a ``mask_mod`` over the pack's unit and
  branch ids, compiled into a block-sparse ``BlockMask``: the tree is kept,
  and under ``torch.compile`` on a GPU fully masked blocks are skipped and no
  ``pack_tokens²`` mask is materialised (eager, as on CPU, it computes the
  full scores: correct, not lighter).

Log-probs without full-vocabulary logits for every token at once: the
model's trunk gives hidden states; the LM head, log-softmax and gather run
over ``chunk_tokens`` positions at a time under activation checkpointing,
so the backward pass recomputes each chunk's logits instead of keeping
``tokens × vocab`` floats alive (the dominant activation for real
vocabularies: 151k × 32k tokens in fp32 is 19 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from learner.context_parallel import ContextGroup, run_share
from learner.grpo import check_prompts


@dataclass(frozen=True)
class Pack:
    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T)
    # per sequence: (index in batch, prompt start, prompt length, completion start, completion length)
    spans: list[tuple[int, int, int, int, int]]
    unit_ids: torch.Tensor  # (T,) which prompt-and-completions unit each token belongs to
    branch_ids: torch.Tensor  # (T,) 0 for a prompt token, k for a token of the unit's k-th completion

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def attention_mask(self) -> torch.Tensor | None:
        """(1, 1, T, T) boolean mask, True where attention is allowed: causal, within a unit, and a
        completion sees its prompt and itself, not the other completions of the prompt. None for a
        pack of one sequence (the plain causal kernel)."""
        if len(self.spans) == 1:
            return None
        idx = torch.arange(self.tokens)
        unit, branch = self.unit_ids, self.branch_ids
        allowed = (unit[:, None] == unit[None, :]) & (idx[None, :] <= idx[:, None])
        allowed &= (branch[None, :] == 0) | (branch[None, :] == branch[:, None])
        return allowed[None, None]

    def block_mask(self, device):
        """The same rule as :meth:`attention_mask`, as FlexAttention's block-sparse ``BlockMask``
        (for every pack: a single sequence is plain causal)."""
        from torch.nn.attention.flex_attention import create_block_mask

        unit, branch = self.unit_ids.to(device), self.branch_ids.to(device)

        def allowed(b, h, q, kv):
            return (unit[q] == unit[kv]) & (kv <= q) & ((branch[kv] == 0) | (branch[kv] == branch[q]))

        return create_block_mask(allowed, B=None, H=None, Q_LEN=self.tokens, KV_LEN=self.tokens, device=device)


def pack_sequences(
    prompts: list[list[int]], completions: list[list[int]], pack_tokens: int, *, share_prompts: bool = True
) -> list[Pack]:
    """First-fit packing in order of units; a unit longer than ``pack_tokens`` gets a pack of its own.

    A unit is one prompt followed by the completions that share it (a GRPO group's samples), so
    the prompt's tokens are in the pack once: with ``share_prompts``, sequences with identical
    prompts form one unit (split into several, each with its own copy of the prompt, where it
    would not fit a pack); without, every sequence is its own unit."""
    groups: dict[object, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p) if share_prompts else i, []).append(i)
    units: list[list[int]] = []
    for members in groups.values():
        plen = len(prompts[members[0]])
        cur: list[int] = []
        size = plen
        for i in members:
            if cur and size + len(completions[i]) > pack_tokens:
                units.append(cur)
                cur, size = [], plen
            cur.append(i)
            size += len(completions[i])
        units.append(cur)
    packs: list[list[list[int]]] = []
    used: list[int] = []
    for unit in units:
        n = len(prompts[unit[0]]) + sum(len(completions[i]) for i in unit)
        for k, u in enumerate(used):
            if u + n <= pack_tokens:
                packs[k].append(unit)
                used[k] += n
                break
        else:
            packs.append([unit])
            used.append(n)
    out = []
    for members in packs:
        ids: list[int] = []
        pos: list[int] = []
        unit_ids: list[int] = []
        branch_ids: list[int] = []
        spans = []
        for u, unit in enumerate(members):
            p = prompts[unit[0]]
            ps = len(ids)
            ids.extend(p)
            pos.extend(range(len(p)))
            unit_ids.extend([u] * len(p))
            branch_ids.extend([0] * len(p))
            for b, i in enumerate(unit, 1):
                c = completions[i]
                spans.append((i, ps, len(p), len(ids), len(c)))
                ids.extend(c)
                pos.extend(range(len(p), len(p) + len(c)))
                unit_ids.extend([u] * len(c))
                branch_ids.extend([b] * len(c))
        out.append(Pack(torch.tensor([ids]), torch.tensor([pos]), spans, torch.tensor(unit_ids), torch.tensor(branch_ids)))
    return out


def uses_flex_attention(model) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", "") == "flex_attention"


def shares_prompts(model) -> bool:
    """Whether packs may hold a prompt once for several completions: not with flash-attn, whose
    varlen kernel takes sequences from restarting position ids (no tree of a prompt and its
    completions)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", "") != "flash_attention_2"


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    logsm = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), dim=-1)
    src = logsm if entropy_grad else logsm.detach()  # trained on only as the entropy bonus
    entropy = -(src.exp() * src).sum(-1)
    return logsm.gather(-1, targets[:, None]).squeeze(-1), entropy


def token_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    chunk_tokens: int = 1024,
    entropy: list | None = None,
    entropy_grad: bool = False,
) -> torch.Tensor:
    """log p(targets[t] | hidden[t]) for every t, ``chunk_tokens`` positions at a time (checkpointed).
    With ``entropy`` (a list), the per-token entropies are appended to it as one tensor (with
    gradient if ``entropy_grad``)."""
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("an LM head with a bias is not supported by the chunked log-prob")
    out, ents = [], []
    for s in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[s : s + chunk_tokens], targets[s : s + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs, h, lm_head.weight, t, entropy_grad, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, lm_head.weight, t, entropy_grad)
        out.append(lp)
        ents.append(ent)
    if entropy is not None and ents:
        entropy.append(torch.cat(ents))
    # no rows: an empty result still on the graph (a context-parallel rank holding none of a pack's
    # rows takes part in the gathers' backward like the others)
    return torch.cat(out) if out else hidden[:0, 0]


class LogprobHead(torch.nn.Module):
    """A causal LM computing packed completion log-probs in its own ``forward``, so that
    wrappers that act on forward (FSDP2's root unshard/reshard) see the whole computation."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids, position_ids, attention_mask, rows, targets, chunk_tokens: int, entropy: list | None = None,
                row_scale=None, entropy_grad: bool = False, ring=None):  # fmt: skip
        trunk = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        extra = {} if ring is None else {"ring": ring}  # a context-parallel share: the pack's ring layout
        hidden = trunk(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **extra)
        hidden = hidden.last_hidden_state[0]
        picked = hidden[rows]
        if row_scale is not None:  # 1/T per row: (h/T) W^T = logits / T, the sampling temperature
            picked = picked * row_scale[:, None].to(picked.dtype)
        return token_logprobs(picked, self.model.get_output_embeddings(), targets, chunk_tokens, entropy, entropy_grad)


def packed_completion_logprobs(
    model,
    prompts: list[list[int]],
    completions: list[list[int]],
    *,
    pack_tokens: int = 4096,
    chunk_tokens: int = 1024,
    entropy: list | None = None,
    temperatures: list[float] | None = None,
    token_entropies: list | None = None,
    share_prompts: bool | None = None,
    context: ContextGroup | None = None,
    stats: dict | None = None,
) -> list[torch.Tensor]:
    """The same values as ``learner.grpo.completion_logprobs``, without padding and without
    full-vocabulary logits for all tokens at once. ``temperatures[i]``: sequence i's sampling
    temperature (None: 1). With ``entropy`` (a list), the mean policy entropy over completion
    tokens is appended to it; with ``token_entropies`` (a list), each sequence's per-token
    entropies (with gradient), one tensor per sequence in input order. ``share_prompts``: lay a
    shared prompt down once (None: whenever the attention kernel allows, :func:`shares_prompts`).
    ``context``: this rank's context-parallel group (``learner/context_parallel.py``), whose ranks
    call this together on the same sequences, each running its share of every pack; with
    ``stats`` (a dict), the padding tokens that made the packs split evenly are added to its
    ``cp_pad_tokens``."""
    check_prompts(prompts, completions)
    ents: list[torch.Tensor] = []
    runner = model if isinstance(model, LogprobHead) else LogprobHead(model)
    flash, flex = not shares_prompts(runner), uses_flex_attention(runner)
    if flash and share_prompts:
        raise ValueError("share_prompts: flash-attn's varlen kernel cannot take a shared prompt (a tree)")
    share = not flash if share_prompts is None else share_prompts
    device = next(runner.parameters()).device
    result: list[torch.Tensor | None] = [None] * len(prompts)
    seq_ents: list[torch.Tensor | None] = [None] * len(prompts)
    for pack in pack_sequences(prompts, completions, pack_tokens, share_prompts=share):
        # flash-attn: sequences from the position ids; ring attention: masks computed tile by tile
        if flex and context is None:
            mask = pack.block_mask(device)
        else:
            mask = None if flash or context is not None else pack.attention_mask()
        # Completion token 0 is predicted from the prompt's last position, token j from token j-1.
        rows, targets, scales = [], [], []
        for i, ps, plen, cs, k in pack.spans:
            rows.append(
                torch.cat([torch.tensor([ps + plen - 1]), torch.arange(cs, cs + k - 1)])
                if k
                else torch.zeros(0, dtype=torch.long)
            )
            targets.append(pack.input_ids[0, cs : cs + k])
            scales.append(torch.full((k,), 1.0 / (temperatures[i] if temperatures else 1.0)))
        to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        scale = to(torch.cat(scales)) if temperatures and any(t != 1.0 for t in temperatures) else None
        before = len(ents)
        if context is not None:
            lp, padding = run_share(runner, pack, torch.cat(rows), torch.cat(targets), scale, context, chunk_tokens, ents,
                                    token_entropies is not None, device)  # fmt: skip
            if stats is not None:
                stats["cp_pad_tokens"] = stats.get("cp_pad_tokens", 0) + padding
        else:
            lp = runner(to(pack.input_ids), to(pack.position_ids), mask if flex or mask is None else to(mask), to(torch.cat(rows)),
                        to(torch.cat(targets)), chunk_tokens, ents, scale, token_entropies is not None)  # fmt: skip
        pack_ents = ents[before] if len(ents) > before else lp.new_zeros(0)  # none if the pack has no completion token
        offset = 0
        for i, _, _, _, k in pack.spans:
            result[i] = lp[offset : offset + k]
            if token_entropies is not None:
                seq_ents[i] = pack_ents[offset : offset + k]
            offset += k
    if entropy is not None:
        all_ents = torch.cat(ents).detach() if ents else torch.zeros(1)
        entropy.append(float(all_ents.mean()))
    if token_entropies is not None:
        token_entropies.extend(seq_ents)
    return result  # type: ignore[return-value]
