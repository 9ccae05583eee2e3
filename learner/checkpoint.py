"""Learner checkpoints in the object store, written atomically.

    runs/<run>/checkpoints/step-<step>.pt     model, optimizer, scheduler, RNG states,
                                              step, policy version, consumed offsets,
                                              the ids trained on (in order), counters
    runs/<run>/checkpoints/latest.json        {"key": ..., "step": ..., "sha256": ...}

The state object is written first and verified by checksum when read; the
small pointer is replaced afterwards (a single PUT: atomic on S3 and on the
local store, which renames a temporary file). A crash between the two leaves
the previous checkpoint current. The newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import io
import json
import random

import torch

from conveyor import keys
from conveyor.objectstore import ObjectNotFound, ObjectStore


def save_checkpoint(store: ObjectStore, run_id: str, state: dict, step: int, keep: int = 2) -> str:
    state = dict(state, rng={"torch": torch.get_rng_state(), "python": random.getstate()})
    buf = io.BytesIO()
    torch.save(state, buf)
    key = keys.checkpoint_key(run_id, step)
    info = store.put(key, buf.getvalue())
    store.put(keys.checkpoint_pointer_key(run_id), json.dumps({"key": key, "step": step, "sha256": info.sha256}).encode())
    older = sorted(i.key for i in store.list(keys.checkpoint_steps_prefix(run_id)))[:-keep]
    for k in older:
        store.delete(k)
    return key


def load_latest(store: ObjectStore, run_id: str) -> dict | None:
    """The newest checkpoint's state (RNG states restored), or None if there is none."""
    try:
        pointer = json.loads(store.get(keys.checkpoint_pointer_key(run_id)))
    except ObjectNotFound:
        return None
    data = store.get(pointer["key"], sha256=pointer.get("sha256"))
    state = torch.load(io.BytesIO(data), weights_only=False)
    rng = state.pop("rng", None)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    return state
