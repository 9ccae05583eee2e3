"""Sharded checkpoints (``learner.checkpoint_layout: sharded``): every rank writes its own shards.

With several ranks, the ``full`` layout gathers the whole model and optimizer state on rank 0
(about 16 bytes per parameter with AdamW: 112 GB for a 7B model), which does not scale. In the
``sharded`` layout each rank writes the pieces it holds of every sharded tensor (FSDP2's DTensors:
model parameters, AdamW's moments) as one safetensors object of its own:

    runs/<run>/checkpoints/step-<step>.rank-<r>.safetensors   rank r's pieces, named by their
                                                               place in the state, each with its
                                                               offset in the whole tensor

and rank 0 writes the checkpoint's manifest and pointer as for the ``full`` layout
(``learner/checkpoint.py``): the state tree holds a ``{"$sharded": {shape, dtype}}`` where each
sharded tensor goes, and ``shards`` lists every rank's object with its sha256 and the pieces it
holds (name -> offset, shape). The manifest's checksum is in the (optionally signed) pointer, so
the shards are covered by it too; like the rest of a checkpoint they are never unpickled.

Reading it back works on any number of ranks: each rank asks the model and optimizer for the
region of every tensor it holds now (its DTensor's offset and local shape; a whole tensor on one
process), fetches only the objects whose pieces overlap it, and copies the overlaps in. A region
the pieces do not cover entirely, or a tensor whose shape is not the checkpoint's, is refused
(``CheckpointRefused``). No rank holds more than its own share, except one process resuming alone,
which holds everything anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from conveyor import keys
from conveyor.errors import CheckpointRefused
from conveyor.objectstore import ObjectStore, sha256_hex

SHARDED = "sharded"
MARK = "$sharded"


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def _leaves(tree, path: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """Every non-dict leaf of nested dicts, with its path of keys."""
    if isinstance(tree, dict) and MARK not in tree:
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    else:
        yield path, tree


def _name(path: tuple) -> str:
    return "/".join(str(k) for k in path)


def _region(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(offset, local shape, local tensor) of what this rank holds of ``t`` (all of a plain tensor)."""
    DTensor = _dtensor_type()
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(offset), tuple(shape), t.to_local()
    return (0,) * t.dim(), tuple(t.shape), t


def _sharded(path: tuple, t) -> bool:
    """Whether a leaf goes to the shards: the model's tensors and the optimizer's per-parameter
    state (not its 0-d step counts, which stay in the manifest's tensors)."""
    return isinstance(t, torch.Tensor) and t.dim() > 0 and path[0] in ("model", "optimizer")


def split(state: dict, rank: int) -> tuple[dict, dict[str, torch.Tensor], dict[str, dict]]:
    """``state`` (``{"model": ..., "optimizer": ...}`` with sharded state dicts) as: the tree with a
    mark in place of each sharded tensor, this rank's pieces, and their index (name -> offset,
    shape). A tensor that is not a DTensor is whole on every rank: rank 0 writes it."""
    DTensor = _dtensor_type()
    pieces: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    storages: set[int] = set()  # tied weights (an LM head that is the embedding) are written twice

    def walk(node, path):
        if isinstance(node, dict):
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, (*path, i)) for i, v in enumerate(node)]
        if not _sharded(path, node):
            return node
        offset, shape, local = _region(node)
        if (isinstance(node, DTensor) or rank == 0) and local.numel():
            name = _name(path)
            piece = local.detach().cpu().contiguous()
            if piece.untyped_storage().data_ptr() in storages:
                piece = piece.clone()  # safetensors refuses two names over one storage
            storages.add(piece.untyped_storage().data_ptr())
            pieces[name] = piece
            index[name] = {"offset": list(offset), "shape": list(shape)}
        return {MARK: {"shape": list(node.shape), "dtype": str(node.dtype).removeprefix("torch.")}}

    return walk(state, ()), pieces, index


def write_shard(store: ObjectStore, run_id: str, step: int, rank: int, pieces: dict[str, torch.Tensor]) -> dict:
    """This rank's object: ``{"key", "sha256"}``."""
    data = save_tensors(pieces, metadata={"format": SHARDED})
    key = keys.checkpoint_shard_key(run_id, step, rank)
    store.put(key, data)
    return {"key": key, "sha256": sha256_hex(data)}


def fill(state: dict, shards: list[dict], store: ObjectStore, run_id: str, *,
         template: Callable[[str], torch.Tensor | None] | None = None, where: str) -> dict:  # fmt: skip
    """``state`` with every mark replaced by its tensor, read from the ``shards`` that overlap it.

    ``template(name)``: the tensor this rank holds now at that place (a DTensor on several ranks);
    it gets the region this rank owns, as a tensor of the same kind. None (one process, or no
    template): whole tensors."""
    prefix = keys.checkpoint_steps_prefix(run_id)
    for ref in shards:
        if not (isinstance(ref, dict) and isinstance(ref.get("key"), str) and ref["key"].startswith(prefix)
                and isinstance(ref.get("sha256"), str) and isinstance(ref.get("pieces"), dict)):  # fmt: skip
            raise CheckpointRefused(f"checkpoint manifest {where}: a shard reference is malformed")
    loaded: dict[int, dict[str, torch.Tensor]] = {}

    def pieces_of(i: int) -> dict[str, torch.Tensor]:
        if i not in loaded:
            ref = shards[i]
            data = store.get(ref["key"], sha256=ref["sha256"])
            try:
                loaded[i] = load_tensors(data)
            except Exception as exc:  # the safetensors parser refuses anything that is not one
                raise CheckpointRefused(f"checkpoint shard {ref['key']} is not a safetensors file: {exc}") from None
        return loaded[i]

    def build(path: tuple, mark: dict) -> torch.Tensor:
        name = _name(path)
        try:
            shape, dtype = tuple(int(x) for x in mark["shape"]), getattr(torch, str(mark["dtype"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointRefused(f"checkpoint manifest {where}: {name} is malformed") from None
        if not isinstance(dtype, torch.dtype):
            raise CheckpointRefused(f"checkpoint manifest {where}: {name} has no dtype")
        like = template(name) if template is not None else None
        if like is not None and tuple(like.shape) != shape:
            raise CheckpointRefused(f"checkpoint {name} has shape {list(shape)}, the model's is {list(like.shape)}")
        offset, local_shape = ((0,) * len(shape), shape) if like is None else _region(like)[:2]
        out = torch.empty(local_shape, dtype=dtype)
        covered = 0
        for i, ref in enumerate(shards):
            got = ref["pieces"].get(name)
            if got is None:
                continue
            try:
                box = _overlap(offset, local_shape, [int(x) for x in got["offset"]], [int(x) for x in got["shape"]])
            except (KeyError, TypeError, ValueError):
                raise CheckpointRefused(
                    f"checkpoint manifest {where}: the index of {ref['key']} is malformed at {name}"
                ) from None
            if box is None:
                continue
            piece = pieces_of(i).get(name)
            if piece is None or list(piece.shape) != list(got["shape"]):
                raise CheckpointRefused(f"checkpoint shard {ref['key']} does not hold {name} as its index says")
            mine, theirs = box
            out[mine] = piece[theirs].to(dtype)
            covered += out[mine].numel()
        if covered != out.numel():
            raise CheckpointRefused(
                f"checkpoint {name}: its shards cover {covered} of the {out.numel()} elements this rank holds"
            )
        if like is not None and isinstance(like, _dtensor_type()):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(out.to(like.device), like.device_mesh, like.placements, shape=like.shape,
                                      stride=like.stride())  # fmt: skip
        return out

    def walk(node, path):
        if isinstance(node, dict) and set(node) == {MARK}:
            return build(path, node[MARK])
        if isinstance(node, dict):
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, (*path, i)) for i, v in enumerate(node)]
        return node

    return walk(state, ())


def _overlap(offset, shape, their_offset, their_shape) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """The slices, in this region and in the piece, of where they overlap (None: nowhere)."""
    if len(their_offset) != len(offset) or len(their_shape) != len(shape):
        return None
    mine, theirs = [], []
    for o, n, to, tn in zip(offset, shape, their_offset, their_shape):
        lo, hi = max(o, to), min(o + n, to + tn)
        if lo >= hi:
            return None
        mine.append(slice(lo - o, hi - o))
        theirs.append(slice(lo - to, hi - to))
    return tuple(mine), tuple(theirs)


def named_leaves(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of a (sharded) state tree by the names ``split`` gives them."""
    return {_name(p): t for p, t in _leaves(state) if isinstance(t, torch.Tensor)}
