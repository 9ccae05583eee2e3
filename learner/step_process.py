"""The learner's optimizer steps in a child process.

In embedded mode (the demo: every service in one process) the learner's
forward and backward passes are many small torch ops with Python between
them, and they share the GIL with the rollout worker, the reward bridge, the
sink and, unless it runs in its own process too, the engine
(``bench/gil_contention.py``: two such loops as threads of one process run
2.4x slower each, as two processes 1.04x). ``StepProcess`` is a trainer with
``Trainer``'s interface (``learner/trainer.py``) whose model, optimizer and
scheduler live in a spawned child, which holds its own ``Trainer``, runs each
step's work and answers with its statistics and the new weights (a
safetensors blob). The parent copies the weights into its own model, so what
it publishes, evaluates and writes into checkpoints is the child's policy;
checkpoints take the optimizer and scheduler state from the child and a
resume loads it there.

One step at a time; a step's work travels as token-id lists and float32
arrays (pickled as plain bytes, not through torch's shared-memory tensor
reduction, which costs a file descriptor and a mapping per tensor). A CPU
learner of one process only: several ranks (``RankGroup``) are processes
already, and a model on a GPU leaves the GIL during its step by itself.
"""

from __future__ import annotations

import io
import multiprocessing
import threading

import numpy as np
import torch

from conveyor.config import LearnerConfig
from learner.distributed import RankGroup
from learner.trainer import Trainer, copy_weights, detached, gather_weights, hf_model


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _serve(conn, model_bytes: bytes, pad_id: int, config: LearnerConfig, threads: int) -> None:
    from safetensors.torch import save

    torch.set_num_threads(threads)
    trainer = Trainer(_from_bytes(model_bytes), pad_id, config)
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
                stats = trainer.step(work)
                conn.send(("ok", (stats, save(trainer.weights()))))
            elif op == "state":
                conn.send(("ok", _to_bytes(trainer.state())))
            elif op == "load":
                *states, fqn_keyed = _from_bytes(payload)
                trainer.load(*states, fqn_keyed=fqn_keyed)
                conn.send(("ok", save(trainer.weights())))
            elif op == "close":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown step-process operation {op!r}")
        except Exception as exc:  # noqa: BLE001 - re-raised in the parent
            conn.send(("error", exc))


class StepProcess:
    """A trainer whose optimizer steps run in a child process (the module's docstring); ``model``
    here receives the weights of each step."""

    def __init__(self, model, pad_id: int, config: LearnerConfig, *, ranks: RankGroup | None = None,
                 threads: int | None = None) -> None:  # fmt: skip
        if ranks is not None:
            raise ValueError("learner.step_process does not combine with several ranks (each rank already is a process)")
        if any(p.device.type != "cpu" for p in model.parameters()):
            raise ValueError(
                "learner.step_process is for a CPU learner (the model is on another device, where the "
                "step leaves the GIL by itself)"
            )
        self.model = model
        self.hf = hf_model(model)
        threads = torch.get_num_threads() if threads is None else threads
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # torch.save, not the pipe's pickling: torch's process reduction would move the parameters
        # into shared memory, and the child's optimizer would then write the parent's tensors.
        self._proc = ctx.Process(target=_serve, args=(child, _to_bytes(model), pad_id, config, threads), daemon=True,
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

    def step(self, work: dict) -> dict:
        """One training step in the child; its statistics (the new weights are copied into ``model``)."""
        wire = dict(work, behaviour=[np.ascontiguousarray(t.numpy(), dtype=np.float32) for t in work["behaviour"]],
                    masks=[np.ascontiguousarray(t.numpy(), dtype=np.float32) for t in work["masks"]])  # fmt: skip
        stats, weights = self._call("step", wire)
        copy_weights(self.hf, weights)
        return stats

    def weights(self) -> dict:
        """The policy's tensors as a Hugging Face checkpoint stores them (``model``'s: the child's last step)."""
        return gather_weights(self.hf)

    def snapshot(self) -> dict:
        """A CPU copy of ``weights()`` that later steps do not change."""
        return detached(self.hf, self.weights())

    def state(self) -> tuple[dict, dict, dict]:
        """The child's full model, optimizer and scheduler state (for a checkpoint)."""
        return _from_bytes(self._call("state"))

    def load(self, model_state: dict, optimizer_state: dict, scheduler_state: dict, *, fqn_keyed: bool = True) -> None:
        """Resume the child from a checkpoint's state (``Trainer.load``), and ``model`` with it."""
        copy_weights(self.hf, self._call("load", _to_bytes((model_state, optimizer_state, scheduler_state, fqn_keyed))))

    def close(self) -> None:
        """Stop the child (``model`` keeps the last weights; a step after this raises)."""
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
