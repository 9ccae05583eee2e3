"""Context parallelism: one packed sequence split across the ranks of a context-parallel group.

With ``learner.context_parallel: N`` the learner's ranks form a device mesh of ``world / N``
data-parallel groups × ``N`` context-parallel ranks (``learner/distributed.py``; FSDP2 shards the
parameters over all ranks, as without it). The ranks of a context-parallel group take the same
packs; each runs the model on its share of every pack's tokens, and attention between the
shares is ring attention (``learner/ring_attention.py``).

The split is the load-balanced causal one: the pack is padded to a multiple of ``2N`` tokens
(padding tokens form a unit of their own, which no real token attends to, and are counted), cut
into ``2N`` blocks, and rank ``r`` holds blocks ``r`` and ``2N - 1 - r``: under a causal mask an
early block has little to attend to and a late one much, so every rank gets one of each and the
same work.

Each rank computes the log-probabilities of the completion tokens whose predicting position it
holds; :func:`gather_rows` puts every rank's values together in order, on every rank of the group,
with a differentiable all-gather, so the loss, its token counts, the entropy and the mismatch
metric are computed on whole sequences exactly as on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from learner.ring_attention import RingLayout


@dataclass(frozen=True)
class ContextGroup:
    """This rank's context-parallel group: its process group (None for one rank), size and place."""

    group: dist.ProcessGroup | None
    size: int
    rank: int


def split(tokens: int, size: int) -> tuple[int, list[torch.Tensor]]:
    """``(padded length, pack positions each rank holds)``: the load-balanced causal split."""
    padded = -(-tokens // (2 * size)) * 2 * size
    block = padded // (2 * size)
    local = [
        torch.cat([torch.arange(r * block, (r + 1) * block), torch.arange((2 * size - 1 - r) * block, (2 * size - r) * block)])
        for r in range(size)
    ]
    return padded, local


@dataclass(frozen=True)
class PackShare:
    """One pack as a rank of the group runs it: its tokens' ids and positions, the ring layout,
    and where every predicting row of the pack is (which rank, which of its tokens)."""

    input_ids: torch.Tensor  # (1, T/N)
    position_ids: torch.Tensor  # (1, T/N)
    layout: RingLayout
    row_owner: torch.Tensor  # (R,) the rank holding each row
    row_local: torch.Tensor  # (R,) its index among that rank's tokens
    padding: int


def share(pack, rows: torch.Tensor, group: ContextGroup, device, tile: int = 1024) -> PackShare:
    """This rank's share of ``pack`` (``learner.packing.Pack``) and the layout of the rows ``rows``."""
    padded, local = split(pack.tokens, group.size)
    pad = padded - pack.tokens
    ids = torch.cat([pack.input_ids[0], torch.zeros(pad, dtype=pack.input_ids.dtype)])
    pos = torch.cat([pack.position_ids[0], torch.arange(pad, dtype=pack.position_ids.dtype)])
    unit = torch.cat([pack.unit_ids, torch.full((pad,), -1, dtype=pack.unit_ids.dtype)])
    branch = torch.cat([pack.branch_ids, torch.zeros(pad, dtype=pack.branch_ids.dtype)])
    owner = torch.empty(padded, dtype=torch.long)
    where = torch.empty(padded, dtype=torch.long)
    for r, held in enumerate(local):
        owner[held] = r
        where[held] = torch.arange(len(held))
    mine = local[group.rank]
    layout = RingLayout(group.group, unit.to(device), branch.to(device), [p.to(device) for p in local], tile)
    return PackShare(ids[mine][None], pos[mine][None], layout, owner[rows], where[rows], pad)


class _AllGather(torch.autograd.Function):
    """All-gather over the group whose backward sums every rank's gradient for this rank's part.
    Not ``torch.distributed.nn.functional.all_gather``: on gloo its backward scatters from group
    ranks as if they were global ones, which fails on any group but the world."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ContextGroup):  # type: ignore[override]
        ctx.group = group
        out = tensor.new_empty(group.size * tensor.numel())  # flat: gloo's gather takes no stacked shape
        dist.all_gather_into_tensor(out, tensor.contiguous().flatten(), group=group.group)
        return out.view(group.size, *tensor.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group.group)
        return grad[ctx.group.rank], None


def gather_rows(values: torch.Tensor, row_owner: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """Every row's value in row order, on every rank of the group, from each rank's values for the
    rows it owns (in row order). Differentiable: a value's gradient reaches the rank that made it."""
    if group.size == 1:
        return values
    counts = torch.bincount(row_owner, minlength=group.size).tolist()
    width = max(counts)
    padded = torch.cat([values, values.new_zeros(width - values.shape[0])])
    parts = _AllGather.apply(padded, group).unbind(0)
    ordered = torch.cat([part[:n] for part, n in zip(parts, counts)])  # rank 0's rows, then rank 1's, ...
    by_rank = torch.argsort(row_owner, stable=True)  # row order -> that order
    return ordered[torch.argsort(by_rank)]


def tile_for(device) -> int:
    """Query and key tokens per tile of scores. A tile's scores, probabilities and their gradients
    live only while it is computed, but are the same size however short a rank's share is: on a
    GPU 1024 (fewer, larger kernels), on a CPU 256 (1/16 of that memory; forward and backward of
    8k tokens took 8% longer than with 1024 on the 2-core machine)."""
    return 1024 if torch.device(device).type == "cuda" else 256


def run_share(runner, pack, rows, targets, scale, group: ContextGroup, chunk_tokens: int, ents: list, entropy_grad: bool,
              device) -> tuple[torch.Tensor, int]:  # fmt: skip
    """The log-probabilities of ``pack``'s rows ``rows`` (predicting ``targets``, scaled by
    ``scale``), this rank running its share through ``runner`` (``learner.packing.LogprobHead``)
    and every rank of the group getting all of them; the rows' entropies are appended to
    ``ents`` the same way. Returns ``(log-probs, padding tokens)``. Collective over the group."""
    part = share(pack, rows, group, device, tile=tile_for(device))
    mine = part.row_owner == group.rank
    to = lambda t: t.to(device)  # noqa: E731
    local_ents: list[torch.Tensor] = []
    lp = runner(to(part.input_ids), to(part.position_ids), None, to(part.row_local[mine]), to(targets[mine]), chunk_tokens,
                local_ents, None if scale is None else scale[mine.to(scale.device)], entropy_grad, ring=part.layout)  # fmt: skip
    owner = to(part.row_owner)
    # A rank holding none of the rows still joins the gathers, with an empty tensor on the same graph.
    ent = local_ents[0] if local_ents else (lp[:0] if entropy_grad else lp.detach()[:0])
    ents.append(gather_rows(ent, owner, group))
    return gather_rows(lp, owner, group), part.padding
