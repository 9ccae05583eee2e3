"""Learner checkpoints in the object store, written atomically.

    runs/<run>/checkpoints/step-<step>.pt     model, optimizer, scheduler, RNG states,
                                              step, policy version, consumed offsets,
                                              the ids trained on (in order), counters
    runs/<run>/checkpoints/latest.json        {"key": ..., "step": ..., "sha256": ...}

The state object is written first and verified by checksum when read; the
small pointer is replaced afterwards (a single PUT: atomic on S3 and on the
local store, which renames a temporary file). A crash between the two leaves
the previous checkpoint current. The newest ``keep`` checkpoints are kept.

The learner checkpoints every ``checkpoint_every`` steps and at a clean stop.
Model and optimizer state are full and FQN-keyed (gathered from every rank),
so a checkpoint written by N ranks resumes on M. With checkpoints on, offsets
are committed to the broker only after a checkpoint (so the broker never runs
ahead of durable state) and a restarted learner resumes from the newest
checkpoint: it seeks to the checkpoint's positions, skips ids the checkpoint
trained on, and re-trains the steps after it, so in the final model's lineage
every rollout is trained on exactly once. Policy versions stay monotonic
across a restart (it continues after the newest version in the object store).
"""

from __future__ import annotations

import asyncio
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


FULL = "full-fqn"  # the layout of checkpoints whose model and optimizer state are full and FQN-keyed


async def write_checkpoint(store: ObjectStore, run_id: str, trainer, progress: dict, *, step: int, keep: int) -> str:
    """Checkpoint ``trainer``'s state (``learner/trainer.py``: collective on several ranks) with
    the learner's ``progress`` (step, version, ledger, positions, counters); its key."""
    model_state, optimizer_state, scheduler_state = await asyncio.to_thread(trainer.state)
    state = {"layout": FULL, "model": model_state, "optimizer": optimizer_state, "scheduler": scheduler_state, **progress}
    return await asyncio.to_thread(save_checkpoint, store, run_id, state, step, keep)


def restore_checkpoint(store: ObjectStore, run_id: str, trainer) -> dict | None:
    """Load the newest checkpoint's training state into ``trainer``; the rest of it (the learner's
    progress), or None when the run has no checkpoint."""
    state = load_latest(store, run_id)
    if state is None:
        return None
    fqn_keyed = state.pop("layout", None) == FULL  # else: written by one process before checkpoints were FQN-keyed
    trainer.load(state.pop("model"), state.pop("optimizer"), state.pop("scheduler"), fqn_keyed=fqn_keyed)
    return state
