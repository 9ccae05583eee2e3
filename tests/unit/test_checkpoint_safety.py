"""Learner checkpoints are data, never code: one test per claim of ``learner/checkpoint.py``.

Exact round trips (model, AdamW state after a step, bf16, int and tuple keys, RNG), pickles
refused without being unpickled, and the pointer's HMAC under ``CONVEYOR_CHECKPOINT_KEY``.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import pickle
import random

import pytest
import torch

from conveyor import keys
from conveyor.errors import CheckpointRefused, ChecksumMismatch
from conveyor.objectstore import LocalObjectStore, sha256_hex
from learner.checkpoint import FULL, KEY_ENV, load_latest, restore_checkpoint, save_checkpoint, write_checkpoint
from learner.distributed import full_model_state, full_optimizer_state, load_full_state

RUN = "run-a"


@pytest.fixture(autouse=True)
def _no_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


@pytest.fixture
def store(tmp_path):
    return LocalObjectStore(tmp_path / "objects")


class Tiny:
    """A model, AdamW and a warm-up schedule after one step: what ``Trainer.state`` returns, and
    ``Trainer.load``'s counterpart."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / 3))

    def train_step(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()

    def state(self):
        return full_model_state(self.model), full_optimizer_state(self.model, self.optimizer), self.scheduler.state_dict()

    def load(self, model_state, optimizer_state, scheduler_state, *, fqn_keyed=True):
        assert fqn_keyed
        load_full_state(self.model, self.optimizer, model_state, optimizer_state)
        self.scheduler.load_state_dict(scheduler_state)


def assert_same(a, b, path="state"):
    """Equal values of the same types all the way down (tensors: dtype, shape and bits)."""
    assert type(a) is type(b) or (isinstance(a, dict) and type(b) is dict), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(next(x for x in b if x == k)), f"{path}: key {k!r} changed type"
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_round_trip_is_exact(store, monkeypatch):
    tiny = Tiny()
    tiny.train_step(1)
    model_state, optimizer_state, scheduler_state = tiny.state()
    plain = tiny.optimizer.state_dict()  # int-keyed state, int params in param groups
    assert set(plain["state"]) == {0, 1, 2, 3}
    state = {
        "layout": FULL,
        "model": model_state,
        "optimizer": optimizer_state,
        "plain_optimizer": plain,
        "scheduler": scheduler_state,
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "int64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "scalar_step": torch.tensor(7.0),
        "transposed": torch.randn(3, 2).t(),
        "empty": torch.zeros(0, 4),
        "step": 12,
        "version": 11,
        "trained_log": ["r-1", "r-2"],
        "settled_ids": {"b", "a"},
        "position": {("scored", 0): 17, ("scored", 1): 4},
        "counters": {"dropped_stale": 3},
        "misc": [None, True, 1.5, float("nan"), float("-inf"), -0.0, 2**70, "$not-a-tag", (1, (2, "x"))],
        "$dollar": {"$tensor": "not a tensor"},
    }
    save_checkpoint(store, RUN, state, step=12)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    loaded = load_latest(store, RUN)
    assert_same(state, loaded)
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert type(loaded["settled_ids"]) is set and loaded["plain_optimizer"]["state"][0]["step"].dtype == torch.float32


def test_restored_optimizer_trains_on_identically(store):
    tiny = Tiny()
    tiny.train_step(1)
    asyncio.run(write_checkpoint(store, RUN, tiny, {"step": 1, "version": 1}, step=1, keep=2))
    tiny.train_step(2)

    other = Tiny(seed=5)  # other weights and no optimizer state until restored
    progress = restore_checkpoint(store, RUN, other)
    assert progress == {"step": 1, "version": 1}
    other.train_step(2)
    for (name, a), b in zip(tiny.model.state_dict().items(), other.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert other.scheduler.get_last_lr() == tiny.scheduler.get_last_lr()


def test_rng_states_come_back(store):
    save_checkpoint(store, RUN, {"step": 1}, step=1)
    after_save = (torch.rand(3), random.random())
    torch.rand(10), random.random()  # move on
    load_latest(store, RUN)
    again = (torch.rand(3), random.random())
    assert torch.equal(after_save[0], again[0]) and after_save[1] == again[1]


def test_tied_tensors_are_stored_once(store):
    shared = torch.randn(256, 64)
    save_checkpoint(store, RUN, {"model": {"embed.weight": shared, "half": shared[:128]}}, step=1)
    save_checkpoint(store, RUN, {"model": {"embed.weight": shared, "lm_head.weight": shared, "half": shared[:128]}}, step=2)
    untied, tied = (store.head(keys.checkpoint_tensors_key(RUN, s)).size for s in (1, 2))
    assert tied - untied < 1024  # one more name in the header, not another copy of the tensor
    model = load_latest(store, RUN)["model"]
    assert torch.equal(model["embed.weight"], shared) and torch.equal(model["lm_head.weight"], shared)
    assert torch.equal(model["half"], shared[:128])


def test_unstorable_objects_are_refused_by_path(store):
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"state\['counters'\]\['bad'\]\[1\].*Opaque"):
        save_checkpoint(store, RUN, {"counters": {"bad": [1, Opaque()]}}, step=1)
    with pytest.raises(TypeError, match=r"state\['ids'\].*frozenset"):
        save_checkpoint(store, RUN, {"ids": frozenset({1})}, step=1)
    assert list(store.list(keys.checkpoints_prefix(RUN))) == []  # nothing half-written


def test_keeps_the_newest_checkpoints(store):
    store.put(keys.checkpoint_steps_prefix(RUN) + "000000001.pt", b"old")
    for step in (2, 3, 4):
        save_checkpoint(store, RUN, {"step": step}, step=step, keep=2)
    left = sorted(i.key.rsplit("/", 1)[-1] for i in store.list(keys.checkpoints_prefix(RUN)))
    assert left == ["latest.json", "step-000000003.json", "step-000000003.safetensors", "step-000000004.json",
                    "step-000000004.safetensors"]  # fmt: skip
    assert load_latest(store, RUN)["step"] == 4


# ------------------------------------------------------------------ pickles


class _Marker:
    """Unpickling this creates ``path``: code from the checkpoint running on the learner."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _payloads(marker) -> dict[str, bytes]:
    buf = io.BytesIO()
    torch.save({"model": _Marker(marker)}, buf)
    return {"torch.save": buf.getvalue(), "pickle": pickle.dumps({"model": _Marker(marker)}, protocol=4)}


def test_the_crafted_pickle_would_run_code(tmp_path):
    for name, payload in _payloads(tmp_path / "ran").items():
        (tmp_path / "ran").unlink(missing_ok=True)
        if name == "pickle":
            pickle.loads(payload)
        else:
            torch.load(io.BytesIO(payload), weights_only=False)
        assert (tmp_path / "ran").exists(), name


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_old_pickle_checkpoint_is_refused(store, tmp_path, kind):
    marker = tmp_path / "ran"
    data = _payloads(marker)[kind]
    key = keys.checkpoint_steps_prefix(RUN) + "000000010.pt"
    store.put(key, data)
    store.put(keys.checkpoint_pointer_key(RUN), json.dumps({"key": key, "step": 10, "sha256": sha256_hex(data)}).encode())
    with pytest.raises(CheckpointRefused, match="old pickle format.*new run"):
        load_latest(store, RUN)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
@pytest.mark.parametrize("part", ["tensors", "manifest", "pointer"])
def test_pickle_in_place_of_any_object_is_refused(store, tmp_path, kind, part):
    marker = tmp_path / "ran"
    data = _payloads(marker)[kind]
    save_checkpoint(store, RUN, {"step": 3, "w": torch.ones(2)}, step=3)
    pointer_key = keys.checkpoint_pointer_key(RUN)
    if part == "pointer":
        store.put(pointer_key, data)
    else:  # a writer of the bucket replaces the object and the checksum the pointer holds for it
        pointer = json.loads(store.get(pointer_key))
        store.put(pointer[part]["key"], data)
        pointer[part]["sha256"] = sha256_hex(data)
        store.put(pointer_key, json.dumps(pointer).encode())
    with pytest.raises(CheckpointRefused, match="pickle"):
        load_latest(store, RUN)
    assert not marker.exists()


def test_malformed_manifest_is_refused(store):
    save_checkpoint(store, RUN, {"step": 3}, step=3)
    pointer_key = keys.checkpoint_pointer_key(RUN)
    pointer = json.loads(store.get(pointer_key))
    bad = json.dumps({"format": 2, "step": 3, "state": {"x": {"$call": ["os.system", "true"]}}}).encode()
    store.put(pointer["manifest"]["key"], bad)
    pointer["manifest"]["sha256"] = sha256_hex(bad)
    store.put(pointer_key, json.dumps(pointer).encode())
    with pytest.raises(CheckpointRefused, match=r"malformed.*\$call"):
        load_latest(store, RUN)


def test_changed_object_fails_its_checksum(store):
    save_checkpoint(store, RUN, {"step": 3}, step=3)
    key = keys.checkpoint_key(RUN, 3)
    store.put(key, store.get(key).replace(b'"step": 3', b'"step": 4'))
    with pytest.raises(ChecksumMismatch):
        load_latest(store, RUN)


# ------------------------------------------------------------------ the pointer's HMAC


def _tamper(store, change) -> None:
    pointer_key = keys.checkpoint_pointer_key(RUN)
    pointer = json.loads(store.get(pointer_key))
    change(pointer)
    store.put(pointer_key, json.dumps(pointer).encode())


def test_signed_round_trip(store, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "learner-secret")
    save_checkpoint(store, RUN, {"step": 5, "w": torch.ones(3)}, step=5)
    assert len(json.loads(store.get(keys.checkpoint_pointer_key(RUN)))["hmac"]) == 64
    state = load_latest(store, RUN)
    assert state["step"] == 5 and torch.equal(state["w"], torch.ones(3))


def test_tampered_pointer_is_refused(store, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "learner-secret")
    save_checkpoint(store, RUN, {"step": 5}, step=5)
    save_checkpoint(store, RUN, {"step": 6}, step=6)
    _tamper(store, lambda p: p.update(step=5, manifest=dict(p["manifest"], key=keys.checkpoint_key(RUN, 5))))
    with pytest.raises(CheckpointRefused, match="signature does not match"):
        load_latest(store, RUN)


def test_tampered_checkpoint_is_refused(store, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "learner-secret")
    save_checkpoint(store, RUN, {"step": 5, "w": torch.ones(3)}, step=5)
    forged = json.dumps({"format": 2, "step": 5, "state": {"step": 5, "w": 0}}).encode()
    key = keys.checkpoint_key(RUN, 5)
    store.put(key, forged)
    with pytest.raises(ChecksumMismatch):  # the signed pointer still holds the real checksum
        load_latest(store, RUN)
    _tamper(store, lambda p: p["manifest"].update(sha256=sha256_hex(forged)))
    with pytest.raises(CheckpointRefused, match="signature does not match"):
        load_latest(store, RUN)


def test_unsigned_pointer_is_refused_when_the_key_is_set(store, monkeypatch):
    save_checkpoint(store, RUN, {"step": 5}, step=5)  # a writer without the key
    monkeypatch.setenv(KEY_ENV, "learner-secret")
    with pytest.raises(CheckpointRefused, match="not signed"):
        load_latest(store, RUN)
    _tamper(store, lambda p: p.update(hmac="0" * 64))
    with pytest.raises(CheckpointRefused, match="signature does not match"):
        load_latest(store, RUN)


def test_another_key_or_run_is_refused(store, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "learner-secret")
    save_checkpoint(store, "run-b", {"step": 5}, step=5)
    other = keys.checkpoint_pointer_key("run-b")
    store.put(keys.checkpoint_pointer_key(RUN), store.get(other))  # a signed pointer of another run
    with pytest.raises(CheckpointRefused, match="not a pointer of run"):
        load_latest(store, RUN)
    monkeypatch.setenv(KEY_ENV, "another-secret")
    with pytest.raises(CheckpointRefused, match="signature does not match"):
        load_latest(store, "run-b")


def test_without_the_key_signed_pointers_still_load(store, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "learner-secret")
    save_checkpoint(store, RUN, {"step": 5}, step=5)
    monkeypatch.delenv(KEY_ENV)
    assert load_latest(store, RUN)["step"] == 5
