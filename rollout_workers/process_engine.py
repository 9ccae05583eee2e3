"""The reference engine in a child process.

Sampling a small model is dominated by Python overhead between many small
torch ops; in one process with the learner (embedded mode) the two contend
for the GIL. ``ProcessEngine`` runs a :class:`ReferenceEngine` in a spawned
child and talks to it over a pipe: ``generate`` and ``load_state_dict`` are
calls into the child (one at a time), encoding and decoding stay local. Same
interface as the in-process engine.
"""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

from rollout_workers.tokenizing import Tokenizing


def _serve(conn, model_dir: str, seed: int, threads: int) -> None:
    from rollout_workers.reference_engine import ReferenceEngine

    engine = ReferenceEngine(model_dir, seed=seed, threads=threads)
    conn.send(("ready", {k: tuple(v.shape) for k, v in engine.model.state_dict().items()}))
    while True:
        try:
            op, args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            if op == "generate":
                conn.send(("ok", engine.generate(*args, **kwargs)))
            elif op == "load":
                engine.load_state_dict(*args)
                conn.send(("ok", None))
            elif op == "load_bytes":  # a safetensors blob, decoded here; a refusal (WeightsRejected) is re-raised in the parent
                engine.load_weights(*args)
                conn.send(("ok", None))
            elif op == "close":
                conn.send(("ok", None))
                return
        except Exception as exc:  # noqa: BLE001 - re-raised in the parent
            conn.send(("error", exc))


class ProcessEngine(Tokenizing):
    def __init__(self, model_dir: str | Path, *, seed: int = 0, threads: int = 1) -> None:
        from transformers import AutoTokenizer

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(model_dir), seed, threads), daemon=True, name="engine")
        self._proc.start()
        child.close()
        self.model_dir = Path(model_dir)  # its own weights: the base of LoRA versions
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.version = 0
        self._lock = threading.Lock()
        status, shapes = self._conn.recv()
        if status != "ready":
            raise RuntimeError("the engine process did not start")
        self.weight_shapes: dict[str, tuple[int, ...]] = shapes  # what a swap must fit (BatchingEngine checks)

    def _call(self, op: str, *args, **kwargs):
        with self._lock:
            self._conn.send((op, args, kwargs))
            status, value = self._conn.recv()
        if status == "error":
            raise value
        return value

    def generate(self, prompts, n, **kwargs):
        return self._call("generate", prompts, n, **kwargs)

    def load_state_dict(self, state: dict, version: int) -> None:
        self._call("load", {k: v.detach().cpu() for k, v in state.items()}, version)
        self.version = version

    def load_weights(self, weights: bytes, version: int) -> None:
        """Swap to a safetensors blob, as published: one write down the pipe, decoded in the child."""
        self._call("load_bytes", weights, version)
        self.version = version

    def close(self) -> None:
        try:
            self._call("close")
        except (EOFError, OSError, BrokenPipeError):
            pass
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
