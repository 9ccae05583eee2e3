"""The pieces of a sharded checkpoint (learner/sharded_checkpoint.py) put back together: whole,
as another rank count's regions, and refused where they do not cover a tensor or do not fit it."""

from __future__ import annotations

import pytest
import torch

from conveyor.errors import CheckpointRefused
from conveyor.objectstore import LocalObjectStore
from learner.sharded_checkpoint import MARK, _overlap, fill, split, write_shard


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 4, generator=g)
    return {"model": {"w": w, "b": torch.randn(4, generator=g)},
            "optimizer": {"state": {"w": {"exp_avg": torch.randn(10, 4, generator=g), "step": torch.tensor(3.0)}},
                          "param_groups": [{"lr": 0.1, "params": ["w"]}]}}  # fmt: skip


def _rows(t: torch.Tensor, lo: int, hi: int) -> tuple[dict, dict]:
    return {"offset": [lo] + [0] * (t.dim() - 1), "shape": [hi - lo, *t.shape[1:]]}, t[lo:hi]


def _two_ranks(store, state) -> list[dict]:
    """``state``'s tensors of two or more dimensions split 6 + 4 rows between two ranks' objects, as
    FSDP2 shards dim 0 (the rest whole on rank 0)."""
    tree, whole, _ = split(state, 0)  # plain tensors: all of them rank 0's
    refs = []
    for rank, (lo, hi) in enumerate([(0, 6), (6, 10)]):
        pieces, index = {}, {}
        for name, t in whole.items():
            if t.dim() > 1:
                index[name], pieces[name] = _rows(t, lo, hi)
            elif rank == 0:
                index[name], pieces[name] = {"offset": [0], "shape": list(t.shape)}, t
        refs.append({**write_shard(store, "r", 1, rank, {k: v.contiguous() for k, v in pieces.items()}), "pieces": index})
    return tree, refs


def test_pieces_come_back_whole_and_the_rest_of_the_tree_stays(tmp_path):
    store, state = LocalObjectStore(tmp_path), _state()
    tree, refs = _two_ranks(store, state)
    assert tree["model"]["w"] == {MARK: {"shape": [10, 4], "dtype": "float32"}}
    assert torch.equal(tree["optimizer"]["state"]["w"]["step"], torch.tensor(3.0))  # 0-d: kept in the tree
    back = fill(tree, refs, store, "r", where="m")
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and torch.equal(back["model"]["b"], state["model"]["b"])
    assert torch.equal(back["optimizer"]["state"]["w"]["exp_avg"], state["optimizer"]["state"]["w"]["exp_avg"])
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]


def test_a_region_of_another_split_is_read_from_the_pieces_that_overlap_it(tmp_path, monkeypatch):
    """Rows 3..7 of three ranks' split read from two ranks' 0..6 and 6..10: both pieces overlap."""
    import learner.sharded_checkpoint as sc

    store, state = LocalObjectStore(tmp_path), _state()
    tree, refs = _two_ranks(store, state)
    monkeypatch.setattr(sc, "_region", lambda t: ((3, 0), (4, 4), t) if t.dim() == 2 else ((0,), tuple(t.shape), t))
    back = fill(tree, refs, store, "r", template={"model/w": torch.empty(10, 4)}.get, where="m")
    assert torch.equal(back["model"]["w"], state["model"]["w"][3:7])


def test_a_tensor_the_shards_do_not_cover_or_that_does_not_fit_is_refused(tmp_path):
    store, state = LocalObjectStore(tmp_path), _state()
    tree, refs = _two_ranks(store, state)
    with pytest.raises(CheckpointRefused, match="model/w: its shards cover 24 of the 40 elements"):
        fill(tree, refs[:1], store, "r", where="m")  # rank 1's object lost
    with pytest.raises(CheckpointRefused, match=r"model/w has shape \[10, 4\], the model's is \[12, 4\]"):
        fill(tree, refs, store, "r", template={"model/w": torch.empty(12, 4)}.get, where="m")
    with pytest.raises(CheckpointRefused, match="a shard reference is malformed"):
        fill(tree, [{**refs[0], "key": "runs/other/checkpoints/step-1.rank-0.safetensors"}], store, "r", where="m")
    with pytest.raises(CheckpointRefused, match="does not hold model/w as its index says"):
        bad = [{**refs[0], "pieces": {**refs[0]["pieces"], "model/w": {"offset": [0, 0], "shape": [5, 4]}}}, refs[1]]
        fill(tree, bad, store, "r", where="m")


def test_overlaps():
    assert _overlap((0,), (6,), (6,), (4,)) is None
    assert _overlap((3, 0), (4, 4), (0, 0), (6, 4)) == ((slice(0, 3), slice(0, 4)), (slice(3, 6), slice(0, 4)))
