"""Learner checkpoints in the object store, written atomically, read without running code.

    runs/<run>/checkpoints/step-<step>.safetensors   every tensor of the state: model, optimizer
                                                     moments and step counts, the torch RNG state
    runs/<run>/checkpoints/step-<step>.json          the manifest: the rest of the state (step,
                                                     policy version, consumed offsets, the ids
                                                     trained on, counters, scheduler, optimizer
                                                     param groups, Python's RNG) as JSON, with each
                                                     tensor's place in it
    runs/<run>/checkpoints/latest.json               the pointer: {"format", "run", "step",
                                                     "manifest": {"key", "sha256"},
                                                     "tensors": {"key", "sha256"}, ["hmac"]}

The two objects are written first and verified by checksum when read; the small pointer is
replaced afterwards (a single PUT: atomic on S3 and on the local store, which renames a
temporary file). A crash before the pointer leaves the previous checkpoint current. The
newest ``keep`` checkpoints up to the one just written are kept; older ones and any written
after it by a lost lineage are deleted.

What it protects against: every role can write the bucket, so a checkpoint is data and
nothing else. It is never unpickled (no ``torch.load``, no ``pickle``): tensors are read by
``safetensors`` and everything else is JSON, and decoding builds only dicts, lists, tuples,
sets, strings, numbers, None and tensors. A checkpoint in the old pickle format is refused,
not loaded. With ``CONVEYOR_CHECKPOINT_KEY`` set in the learner's environment (and only
there), the pointer carries an HMAC-SHA256 of its content (the run, step, and both objects'
keys and checksums), so a writer without the key cannot make the learner load a checkpoint
of its own: a pointer whose signature is missing or wrong is refused.
What it does not protect against: without the key, a bucket writer can still replace a
checkpoint with other (well-formed) weights and progress; with it, a writer can still delete
checkpoints, or put back an older signed pointer of the same run whose objects still exist
(a rollback, not code).

The state is a tree of dicts, lists, tuples, sets, str, int, float, bool, None and dense
tensors; anything else is refused when saving, with its place in the tree. Keys other than
str (optimizer state's int keys, the batcher's (topic, partition) keys) and tuples and sets
come back as they were. Mappings come back as plain dicts, in order, and tensors on the CPU.

The learner checkpoints every ``checkpoint_every`` steps and at a clean stop.
Model and optimizer state are full and FQN-keyed (gathered from every rank),
or, with ``learner.checkpoint_layout: sharded`` on several ranks, written by
each rank as its own shards (``learner/sharded_checkpoint.py``); either way a
checkpoint written by N ranks resumes on M. With checkpoints on, offsets
are committed to the broker only after a checkpoint (so the broker never runs
ahead of durable state) and a restarted learner resumes from the newest
checkpoint: it seeks to the checkpoint's positions, skips ids the checkpoint
trained on, and re-trains the steps after it, so in the final model's lineage
every rollout is trained on exactly once. Policy versions stay monotonic
across a restart (it continues after the newest version in the object store).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import random

import structlog
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from conveyor import keys
from conveyor.errors import CheckpointRefused
from conveyor.objectstore import ObjectNotFound, ObjectStore, sha256_hex
from learner.sharded_checkpoint import SHARDED, fill

log = structlog.get_logger(__name__)

FORMAT = 2  # the pointer's and manifest's "format"; pointers without one are the old pickle format
KEY_ENV = "CONVEYOR_CHECKPOINT_KEY"  # the learner's pointer-signing secret; no other role gets it
_SCALARS = (bool, int, float, str)


def save_checkpoint(store: ObjectStore, run_id: str, state: dict, step: int, keep: int = 2) -> str:
    """Write ``state`` (with the RNG states) as the run's newest checkpoint; its manifest's key."""
    state = dict(state, rng={"torch": torch.get_rng_state(), "python": random.getstate()})
    encoder = _Encoder()
    tree = encoder.encode(state, ())  # refuses what it cannot store before anything is written
    manifest = json.dumps({"format": FORMAT, "step": step, "state": tree}).encode()
    tensors = save_tensors(encoder.tensors, metadata={"format": str(FORMAT)})
    manifest_key, tensors_key = keys.checkpoint_key(run_id, step), keys.checkpoint_tensors_key(run_id, step)
    store.put(tensors_key, tensors)
    store.put(manifest_key, manifest)
    pointer = {
        "format": FORMAT,
        "run": run_id,
        "step": step,
        "manifest": {"key": manifest_key, "sha256": sha256_hex(manifest)},
        "tensors": {"key": tensors_key, "sha256": sha256_hex(tensors)},
    }
    secret = _secret()
    if secret is not None:
        pointer["hmac"] = _signature(secret, pointer)
    store.put(keys.checkpoint_pointer_key(run_id), json.dumps(pointer).encode())
    _prune(store, run_id, step, keep)
    return manifest_key


def load_latest(store: ObjectStore, run_id: str) -> dict | None:
    """The newest checkpoint's state (RNG states restored), or None if there is none.
    Raises ``CheckpointRefused`` for a pickled checkpoint or a pointer that fails its signature,
    ``ChecksumMismatch`` when an object is not the one the pointer names."""
    pointer_key = keys.checkpoint_pointer_key(run_id)
    try:
        raw = store.get(pointer_key)
    except ObjectNotFound:
        return None
    pointer = _read_pointer(raw, pointer_key, run_id)
    manifest_key = pointer["manifest"]["key"]
    data = store.get(manifest_key, sha256=pointer["manifest"]["sha256"])
    if _looks_pickled(data):
        raise CheckpointRefused(_legacy(manifest_key))
    manifest = _json_object(data, f"checkpoint manifest {manifest_key}")
    if manifest.get("format") != FORMAT or manifest.get("step") != pointer["step"]:
        raise CheckpointRefused(f"checkpoint manifest {manifest_key} does not match its pointer {pointer_key}")
    tensors_key = pointer["tensors"]["key"]
    data = store.get(tensors_key, sha256=pointer["tensors"]["sha256"])
    try:
        tensors = load_tensors(data)
    except Exception as exc:  # the safetensors parser refuses anything that is not one
        if _looks_pickled(data):
            raise CheckpointRefused(_legacy(tensors_key)) from None
        raise CheckpointRefused(f"checkpoint tensors {tensors_key} are not a safetensors file: {exc}") from None
    state = _decode(manifest.get("state"), tensors, (), manifest_key)
    if not isinstance(state, dict):
        raise CheckpointRefused(f"checkpoint manifest {manifest_key}: its state is not a dict")
    rng = state.pop("rng", None)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    return state


FULL = "full-fqn"  # the layout of checkpoints whose model and optimizer state are full and FQN-keyed


async def write_checkpoint(store: ObjectStore, run_id: str, trainer, progress: dict, *, step: int, keep: int) -> str:
    """Checkpoint ``trainer``'s state (``learner/trainer.py``: collective on several ranks) with
    the learner's ``progress`` (step, version, ledger, positions, counters); its key."""
    if getattr(trainer, "ranks", None) is not None and trainer.config.checkpoint_layout == SHARDED:
        tree, shards = await asyncio.to_thread(trainer.sharded_state, run_id, step)  # each rank writes its own
        state = {"layout": SHARDED, **tree, "shards": shards, "scheduler": trainer.scheduler.state_dict(), **progress}
    else:
        model_state, optimizer_state, scheduler_state = await asyncio.to_thread(trainer.state)
        state = {"layout": FULL, "model": model_state, "optimizer": optimizer_state, "scheduler": scheduler_state, **progress}
    return await asyncio.to_thread(save_checkpoint, store, run_id, state, step, keep)


def restore_checkpoint(store: ObjectStore, run_id: str, trainer) -> dict | None:
    """Load the newest checkpoint's training state into ``trainer``; the rest of it (the learner's
    progress), or None when the run has no checkpoint."""
    state = load_latest(store, run_id)
    if state is None:
        return None
    layout = state.pop("layout", None)
    if layout == SHARDED:
        tree, shards = {"model": state.pop("model"), "optimizer": state.pop("optimizer")}, state.pop("shards")
        where = keys.checkpoint_key(run_id, state.get("step", 0))
        if getattr(trainer, "ranks", None) is not None:  # each rank reads its share
            trainer.load_sharded(tree, shards, state.pop("scheduler"), run_id, where)
        else:  # one process holds it all: the whole tensors, loaded as a full checkpoint's
            whole = fill(tree, shards, store, run_id, where=where)
            trainer.load(whole["model"], whole["optimizer"], state.pop("scheduler"), fqn_keyed=True)
        return state
    fqn_keyed = layout == FULL  # else: plain state_dict()s of one process
    trainer.load(state.pop("model"), state.pop("optimizer"), state.pop("scheduler"), fqn_keyed=fqn_keyed)
    return state


# ------------------------------------------------------------------ the pointer


def _secret() -> bytes | None:
    """Read at each use, so a learner started with the key signs and checks every pointer."""
    value = os.environ.get(KEY_ENV, "")
    return value.encode() if value else None


def _signature(secret: bytes, pointer: dict) -> str:
    body = json.dumps({k: v for k, v in pointer.items() if k != "hmac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


def _json_object(data: bytes, what: str) -> dict:
    try:
        value = json.loads(data)
    except ValueError:
        raise CheckpointRefused(f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise CheckpointRefused(f"{what} is not a JSON object")
    return value


def _read_pointer(raw: bytes, pointer_key: str, run_id: str) -> dict:
    """The pointer, once it is known to be this run's, in this format and (with a key) signed by it."""
    if _looks_pickled(raw):
        raise CheckpointRefused(_legacy(pointer_key))
    pointer = _json_object(raw, f"checkpoint pointer {pointer_key}")
    if "format" not in pointer:  # {"key": ".../step-<n>.pt", "step", "sha256"}: a torch.save pickle
        raise CheckpointRefused(_legacy(str(pointer.get("key", pointer_key))))
    secret = _secret()
    if secret is not None:
        signature = pointer.get("hmac")
        if not isinstance(signature, str):
            raise CheckpointRefused(
                f"checkpoint pointer {pointer_key} is not signed but {KEY_ENV} is set: it was written by a learner "
                f"without the key, or by someone who does not hold it; refusing to load it"
            )
        if not hmac.compare_digest(signature.encode(), _signature(secret, pointer).encode()):
            raise CheckpointRefused(
                f"checkpoint pointer {pointer_key}: its signature does not match {KEY_ENV} (written with another "
                f"key, or changed after it was signed); refusing to load it"
            )
    elif "hmac" in pointer:
        log.warning("learner.checkpoint_unverified", pointer=pointer_key, reason=f"signed, but {KEY_ENV} is not set")
    if pointer["format"] != FORMAT:
        raise CheckpointRefused(f"checkpoint pointer {pointer_key} has format {pointer['format']!r}; this learner reads {FORMAT}")
    if pointer.get("run") != run_id or type(pointer.get("step")) is not int:
        raise CheckpointRefused(f"checkpoint pointer {pointer_key} is not a pointer of run {run_id!r}")
    prefix = keys.checkpoint_steps_prefix(run_id)
    for part in ("manifest", "tensors"):
        ref = pointer.get(part)
        if not (isinstance(ref, dict) and isinstance(ref.get("key"), str) and isinstance(ref.get("sha256"), str)):
            raise CheckpointRefused(f"checkpoint pointer {pointer_key} names no {part} key and sha256")
        if not ref["key"].startswith(prefix):
            raise CheckpointRefused(f"checkpoint pointer {pointer_key} names {ref['key']!r}, outside {prefix}")
    return pointer


def _looks_pickled(data: bytes) -> bool:
    """torch.save writes a zip archive around a pickle; a bare pickle (protocol 2+) opens with PROTO."""
    return data[:4] == b"PK\x03\x04" or data[:1] == b"\x80"


def _legacy(what: str) -> str:
    return (
        f"checkpoint {what} is in the old pickle format (torch.save) and is not loaded: unpickling runs whatever "
        f"code a writer of the object store put in it. Start a new run (a new run id, or remove its checkpoints/ "
        f"prefix), or convert it offline on a trusted machine: torch.load(..., weights_only=True), then "
        f"learner.checkpoint.save_checkpoint(...) into the run"
    )


def _prune(store: ObjectStore, run_id: str, step: int, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints up to ``step`` (the pointer's); objects of a higher step
    are a lost lineage's (written before a crash, never pointed to) and go too."""
    by_step: dict[int, list[str]] = {}
    for info in store.list(keys.checkpoint_steps_prefix(run_id)):
        s = keys.checkpoint_step(info.key)
        if s is not None:
            by_step.setdefault(s, []).append(info.key)
    kept = set(sorted(s for s in by_step if s <= step)[-keep:]) | {step}
    for s, ks in by_step.items():
        if s not in kept:
            for k in ks:
                store.delete(k)


# ------------------------------------------------------------------ the state


def _where(path: tuple) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


class _Encoder:
    """Turns a state tree into JSON and named tensors. A tensor seen twice (tied weights) is stored
    once and comes back as one tensor; safetensors refuses two names over one storage, so a
    different view of a storage already stored is copied."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, str] = {}
        self._storages: set[int] = set()

    def encode(self, value, path: tuple):
        kind = type(value)
        if value is None or kind in _SCALARS:
            return value
        if isinstance(value, torch.Tensor):
            return {"$tensor": self._tensor(value, path)}
        if kind is list:
            return [self.encode(v, (*path, i)) for i, v in enumerate(value)]
        if kind is tuple:
            return {"$tuple": [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        if kind is set:
            return {"$set": [self.encode(v, (*path, v)) for v in _ordered(value)]}
        if isinstance(value, dict):
            if all(type(k) is str and not k.startswith("$") for k in value):
                return {k: self.encode(v, (*path, k)) for k, v in value.items()}
            return {"$dict": [[self._key(k, path), self.encode(v, (*path, k))] for k, v in value.items()]}
        raise TypeError(
            f"checkpoint {_where(path)} is a {kind.__module__}.{kind.__qualname__}: a checkpoint holds only dicts, "
            f"lists, tuples, sets, str, int, float, bool, None and tensors"
        )

    def _key(self, key, path: tuple):
        if isinstance(key, torch.Tensor):
            raise TypeError(f"checkpoint {_where(path)} has a tensor as a key")
        return self.encode(key, (*path, key))

    def _tensor(self, tensor: torch.Tensor, path: tuple) -> str:
        t = tensor.detach()
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            raise TypeError(
                f"checkpoint {_where(path)} is a {type(t).__qualname__} ({t.layout}): gather it into a dense tensor first"
            )
        view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.nbytes and view in self._views:
            return self._views[view]
        t = t.cpu().contiguous()
        if t.nbytes and t.untyped_storage().data_ptr() in self._storages:
            t = t.clone()
        name = "/".join(str(k) for k in path) or "state"
        while name in self.tensors:
            name += "'"
        self.tensors[name] = t
        if t.nbytes:
            self._views[view] = name
            self._storages.add(t.untyped_storage().data_ptr())
        return name


def _ordered(items: set) -> list:
    try:
        return sorted(items)
    except TypeError:  # mixed types: any fixed order will do, the set's order is not kept
        return sorted(items, key=repr)


def _decode(node, tensors: dict, path: tuple, where: str):
    """Rebuild what ``_Encoder.encode`` wrote; builds nothing but containers, scalars and tensors."""
    if node is None or type(node) in _SCALARS:
        return node
    if type(node) is list:
        return [_decode(v, tensors, (*path, i), where) for i, v in enumerate(node)]
    if type(node) is not dict:
        raise CheckpointRefused(f"checkpoint manifest {where}: {_where(path)} is not checkpoint data")
    tag = next(iter(node), "")
    if not tag.startswith("$"):
        return {k: _decode(v, tensors, (*path, k), where) for k, v in node.items()}
    body = node[tag]
    try:
        if len(node) == 1 and tag == "$tensor" and body in tensors:
            return tensors[body]
        if len(node) == 1 and tag in ("$tuple", "$set") and type(body) is list:
            items = [_decode(v, tensors, (*path, i), where) for i, v in enumerate(body)]
            return tuple(items) if tag == "$tuple" else set(items)
        if len(node) == 1 and tag == "$dict" and type(body) is list:
            pairs = [(_decode(k, tensors, path, where), v) for k, v in body]
            return {k: _decode(v, tensors, (*path, k), where) for k, v in pairs}
    except (TypeError, ValueError) as exc:  # an unhashable key or a pair that is not one
        raise CheckpointRefused(f"checkpoint manifest {where}: {_where(path)} is malformed: {exc}") from None
    raise CheckpointRefused(f"checkpoint manifest {where}: {_where(path)} is malformed ({tag!r})")
