"""Ring attention: exact causal attention over a packed sequence split across a context-parallel group.

Every rank of the group holds a share of the pack's tokens (``learner/context_parallel.py`` lays
them out: a block from the front of the pack and its mirror from the back, so every rank does the
same causal work). An attention layer runs :class:`RingAttention` on the rank's queries, keys and
values; the key/value blocks then travel around the group (rank ``r`` sends to ``r + 1`` and
receives from ``r - 1``, the next block in flight while the current one is computed), and each
rank accumulates its queries' outputs block by block with the online-softmax merge: a running
log-sum-exp per query row, every new partial output rescaled to it. The backward pass is exact:
the key/value blocks go round again with their gradient accumulators, each rank adds its queries'
share, and after a full turn every block is home with its whole gradient.

Masks are computed, not stored: each token's position in the pack, the prompt-and-completions
unit it belongs to and its branch (``learner/packing.py``'s ``Pack``) are known to every rank, so
the mask of a query tile against a key tile (causal, within a unit, a completion sees its prompt
and itself, not its siblings) is built for that tile only, and a tile wholly in the future is
skipped. Tiles of ``tile`` × ``tile`` scores bound the transient memory, so a rank's memory is
linear in its share of the pack.

The ring runs on ``torch.distributed`` point-to-point operations of the group (gloo on CPU, NCCL
on GPUs). torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``)
takes only the plain causal mask through SDPA, not a pack of several documents, which is what
the learner trains on (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

IMPLEMENTATION = "conveyor_ring"
"""The name this kernel is registered under in transformers' ``AttentionInterface``."""


@dataclass
class RingLayout:
    """One pack as the context-parallel group holds it: the group, and for every token of the
    (padded) pack its unit and branch; ``local[r]``: the pack positions rank ``r`` holds, in order."""

    group: dist.ProcessGroup | None
    unit: torch.Tensor
    branch: torch.Tensor
    local: list[torch.Tensor]
    tile: int = 1024

    def __post_init__(self) -> None:
        self.size = len(self.local)
        self.rank = dist.get_rank(self.group) if self.size > 1 else 0
        # per rank: positions, units and branches of its tokens, and the bounds of each tile's positions
        self.meta = [(pos, self.unit[pos], self.branch[pos]) for pos in self.local]
        self.bounds = [
            [(int(pos[a : a + self.tile].min()), int(pos[a : a + self.tile].max())) for a in range(0, len(pos), self.tile)]
            for pos in (p.cpu() for p in self.local)
        ]

    def rotate(self, tensor: torch.Tensor, tag: int):
        """Start sending ``tensor`` to the next rank and receiving the previous rank's; returns a
        callable that waits and gives the received tensor (``tensor`` itself on a group of one)."""
        if self.size == 1:
            return lambda: tensor
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag),
        ]
        works = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return received

        return wait


def _mask(layout: RingLayout, qr: int, kr: int, qa: int, ka: int) -> torch.Tensor | None:
    """Where rank ``qr``'s query tile at ``qa`` may attend rank ``kr``'s key tile at ``ka`` (None: nowhere)."""
    tile = layout.tile
    _, q_hi = layout.bounds[qr][qa // tile]
    k_lo, _ = layout.bounds[kr][ka // tile]
    if k_lo > q_hi:  # the whole key tile comes after every query: causal, nothing to see
        return None
    qpos, qunit, qbranch = (t[qa : qa + tile] for t in layout.meta[qr])
    kpos, kunit, kbranch = (t[ka : ka + tile] for t in layout.meta[kr])
    allowed = (qunit[:, None] == kunit[None, :]) & (kpos[None, :] <= qpos[:, None])
    allowed &= (kbranch[None, :] == 0) | (kbranch[None, :] == qbranch[:, None])
    return allowed if bool(allowed.any()) else None


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision inputs (bf16 under autocast), else the input's own."""
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def _scores(q, k, mask, scale):
    s = torch.matmul(q, k[:, None].transpose(-1, -2)) * scale  # (Hkv, g, tq, tk)
    return s.masked_fill_(~mask, float("-inf"))


def _forward_block(layout, q, k, v, kr, scale, out, lse) -> None:
    """Merge rank ``kr``'s key/value block into this rank's outputs and log-sum-exps (in place)."""
    tile = layout.tile
    for qa in range(0, q.shape[2], tile):
        for ka in range(0, k.shape[1], tile):
            mask = _mask(layout, layout.rank, kr, qa, ka)
            if mask is None:
                continue
            s = _scores(q[:, :, qa : qa + tile], k[:, ka : ka + tile], mask, scale)
            block_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - torch.where(torch.isfinite(block_lse), block_lse, 0.0)[..., None])
            block_out = torch.matmul(p, v[:, None, ka : ka + tile])
            # The online-softmax merge: both partial outputs rescaled to the combined normaliser.
            old_lse = lse[:, :, qa : qa + tile]
            new_lse = torch.logaddexp(old_lse, block_lse)
            base = torch.where(torch.isfinite(new_lse), new_lse, 0.0)
            o = out[:, :, qa : qa + tile]
            o.mul_(torch.exp(old_lse - base)[..., None]).add_(block_out * torch.exp(block_lse - base)[..., None])
            old_lse.copy_(new_lse)


def _backward_block(layout, q, k, v, dout, lse, delta, kr, scale, dq, dk, dv) -> None:
    """This rank's queries' share of the gradients through rank ``kr``'s block (accumulated in place)."""
    tile = layout.tile
    for qa in range(0, q.shape[2], tile):
        qs = slice(qa, qa + tile)
        for ka in range(0, k.shape[1], tile):
            mask = _mask(layout, layout.rank, kr, qa, ka)
            if mask is None:
                continue
            ks = slice(ka, ka + tile)
            p = torch.exp(_scores(q[:, :, qs], k[:, ks], mask, scale) - lse[:, :, qs, None])
            dv[:, ks] += torch.matmul(p.transpose(-1, -2), dout[:, :, qs]).sum(1)
            dp = torch.matmul(dout[:, :, qs], v[:, None, ks].transpose(-1, -2))
            ds = p * (dp - delta[:, :, qs, None])
            dq[:, :, qs] += torch.matmul(ds, k[:, None, ks]) * scale
            dk[:, ks] += torch.matmul(ds.transpose(-1, -2), q[:, :, qs]).sum(1) * scale


class RingAttention(torch.autograd.Function):
    """``softmax(q kᵀ · scale + mask) v`` for this rank's queries against the whole pack's keys.
    q: (1, H, T, D); k, v: (1, Hkv, T, D) (grouped-query heads: H a multiple of Hkv). fp32 math
    for half-precision inputs."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, layout: RingLayout):  # type: ignore[override]
        _, heads, tokens, dim = q.shape
        kv_heads = k.shape[1]
        math = _math_dtype(q)
        qg = q[0].reshape(kv_heads, heads // kv_heads, tokens, dim).to(math)
        out = qg.new_zeros(qg.shape)
        lse = qg.new_full(qg.shape[:-1], float("-inf"))
        kv = torch.stack([k[0], v[0]])
        for step in range(layout.size):
            source = (layout.rank - step) % layout.size
            pending = layout.rotate(kv, tag=0) if step < layout.size - 1 else None
            _forward_block(layout, qg, kv[0].to(math), kv[1].to(math), source, scale, out, lse)
            if pending is not None:
                kv = pending()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.layout = scale, layout
        return out.reshape(heads, tokens, dim)[None].to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        _, heads, tokens, dim = q.shape
        kv_heads = k.shape[1]
        math = _math_dtype(q)
        qg = q[0].reshape(kv_heads, heads // kv_heads, tokens, dim).to(math)
        dout = dout[0].reshape(qg.shape).to(math)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k[0], v[0]])
        dkv = torch.zeros(kv.shape, dtype=math, device=kv.device)  # the held block's gradient so far
        for step in range(layout.size):
            source = (layout.rank - step) % layout.size
            pending = layout.rotate(kv, tag=0) if step < layout.size - 1 else None
            _backward_block(layout, qg, kv[0].to(math), kv[1].to(math), dout, lse, delta, source, scale, dq, dkv[0], dkv[1])
            dkv = layout.rotate(dkv, tag=1)()  # on with the block; after a full turn, this rank's own comes home
            if pending is not None:
                kv = pending()
        dq_out = dq.reshape(heads, tokens, dim)[None].to(q.dtype)
        return dq_out, dkv[0][None].to(k.dtype), dkv[1][None].to(v.dtype), None, None


def ring_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, ring=None, **kwargs):
    """transformers' attention-function signature (``AttentionInterface``): the layer's queries,
    keys and values for this rank's tokens, ``ring`` the pack's :class:`RingLayout` (passed down
    by ``learner.packing.LogprobHead``). Returns ``(output (1, T, H, D), None)``."""
    if ring is None:
        raise RuntimeError(
            f"the {IMPLEMENTATION!r} attention runs inside the learner's context-parallel log-prob pass "
            "(learner/packing.py), which passes each pack's layout"
        )
    if dropout:
        raise RuntimeError("ring attention takes no attention dropout")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = RingAttention.apply(query, key, value, scale, ring)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make :func:`ring_attention_forward` a transformers attention implementation; its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, ring_attention_forward)
    return IMPLEMENTATION
