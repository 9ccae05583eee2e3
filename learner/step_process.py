"""The learner's optimizer steps in a child process.

In embedded mode (the demo: every service in one process) the learner's
forward and backward passes are many small torch ops with Python between
them, and they share the GIL with the rollout worker, the reward bridge, the
sink and, unless it runs in its own process too, the engine
(``bench/gil_contention.py``: two such loops as threads of one process run
2.4x slower each, as two processes 1.04x). ``StepProcess`` keeps the
learner's model, optimizer and scheduler in a spawned child, which runs
``GRPOLearner._optimise`` on each step's work and answers with its
statistics and the new weights (a safetensors blob). The parent copies the
weights into its own model, so what it publishes, evaluates and writes into
checkpoints is the child's policy; checkpoints take the optimizer and
scheduler state from the child and a resume loads it there.

One step at a time; a step's work travels as token-id lists and float32
arrays (pickled as plain bytes, not through torch's shared-memory tensor
reduction, which costs a file descriptor and a mapping per tensor). One
process only: several ranks (``RankGroup``) have their own followers.
"""

from __future__ import annotations

import io
import multiprocessing
import threading

import numpy as np


def _to_bytes(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _serve(conn, model_bytes: bytes, pad_id: int, options: dict, threads: int) -> None:
    import torch
    from safetensors.torch import save

    from learner.recipe import GRPOLearner

    torch.set_num_threads(threads)
    # The learner object only trains here: it never runs a service (no transport, topics or store).
    learner = GRPOLearner(None, None, _from_bytes(model_bytes), pad_id, None, **options)
    conn.send(("ready", None))
    while True:
        try:
            op, payload = conn.recv()
        except EOFError:
            return
        try:
            if op == "step":
                work = dict(payload, behaviour=[torch.from_numpy(a) for a in payload["behaviour"]],
                            masks=[torch.from_numpy(a) for a in payload["masks"]])  # fmt: skip
                stats = learner._optimise(work)
                conn.send(("ok", (stats, save(learner._gather_weights()))))
            elif op == "state":
                model_state, optimizer_state = learner._gather_state()
                conn.send(("ok", _to_bytes((model_state, optimizer_state, learner.scheduler.state_dict()))))
            elif op == "load":
                learner._load_full(*_from_bytes(payload))
                conn.send(("ok", None))
            elif op == "close":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown step-process operation {op!r}")
        except Exception as exc:  # noqa: BLE001 - re-raised in the parent
            conn.send(("error", exc))


class StepProcess:
    """A child process holding a copy of ``model`` with its own optimizer and scheduler
    (``options``: GRPOLearner's training keywords: lr, loss, warmup_steps, pack_tokens, ...)."""

    def __init__(self, model, pad_id: int, options: dict, *, threads: int = 1) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # torch.save, not the pipe's pickling: torch's process reduction would move the parameters
        # into shared memory, and the child's optimizer would then write the parent's tensors.
        self._proc = ctx.Process(target=_serve, args=(child, _to_bytes(model), pad_id, options, threads), daemon=True,
                                 name="learner-steps")  # fmt: skip
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._closed = False
        try:
            status, _ = self._conn.recv()
        except EOFError:
            status = "died"
        if status != "ready":
            self._proc.join(5)
            raise RuntimeError(f"the learner's step process did not start (exit code {self._proc.exitcode})")

    def _call(self, op: str, payload=None):
        if self._closed:
            raise RuntimeError("the learner's step process is closed")
        with self._lock:
            self._conn.send((op, payload))
            try:
                status, value = self._conn.recv()
            except EOFError:
                raise RuntimeError(f"the learner's step process died (exit code {self._proc.exitcode})") from None
        if status == "error":
            raise value
        return value

    def step(self, work: dict) -> tuple[dict, bytes]:
        """One optimizer step in the child: its statistics and the new weights (safetensors)."""
        wire = dict(work, behaviour=[np.ascontiguousarray(t.numpy(), dtype=np.float32) for t in work["behaviour"]],
                    masks=[np.ascontiguousarray(t.numpy(), dtype=np.float32) for t in work["masks"]])  # fmt: skip
        return self._call("step", wire)

    def state(self) -> tuple[dict, dict, dict]:
        """The child's full model, optimizer and scheduler state (for a checkpoint)."""
        return _from_bytes(self._call("state"))

    def load(self, model_state: dict, optimizer_state: dict, scheduler_state: dict) -> None:
        """Resume the child from a checkpoint's full state."""
        self._call("load", _to_bytes((model_state, optimizer_state, scheduler_state)))

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._call("close")
        except (EOFError, OSError, RuntimeError):
            pass
        self._closed = True
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
