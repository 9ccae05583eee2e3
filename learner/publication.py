"""The learner's publications: policy weights for the rollout workers, progress for admission.

- A published policy is stored as safetensors under its versioned key
  (``conveyor.keys.weights_key``; the version counts the learner's steps) and announced on the
  weights topic; versions beyond the newest ``keep_versions`` are deleted (listed under
  ``conveyor.keys.weights_prefix``, so versions an earlier process of this run left go too).
- Progress (samples consumed, policy version, step, the last step's reward and staleness)
  goes to the progress topic: the rollout workers' admission tickets are compared against its
  ``samples_consumed``.
- A step's publication (its weights, if it publishes, then its progress report) runs while the
  next step trains: for a large model, serialising and uploading takes seconds. ``start`` begins
  it and ``wait`` waits for it; the recipe waits before starting the next, so publications stay
  in order, and a step's progress report never precedes its weights, so a worker admitted by it
  already sees that version.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from conveyor import keys
from conveyor.contracts import LearnerProgress, WeightsAnnouncement
from conveyor.messaging import Publisher
from conveyor.objectstore import ObjectStore


def publish_dtype(config_value: str, *, on_gpu: bool) -> str:
    """``LearnerConfig.publish_dtype`` resolved: auto is bfloat16 on a GPU, float32 on a CPU."""
    if config_value != "auto":
        return config_value
    return "bfloat16" if on_gpu else "float32"


def cast(state: dict, dtype: str) -> dict:
    """``state`` with its floating tensors in ``dtype`` (integer buffers as they are)."""
    import torch

    target = getattr(torch, dtype)
    return {k: v.to(target) if v.is_floating_point() and v.dtype != target else v for k, v in state.items()}


class Publication:
    """Weights and progress of one run, and the step publication in flight."""

    def __init__(self, store: ObjectStore, run_id: str, keep_versions: int, dtype: str = "float32",
                 metadata: dict[str, str] | None = None) -> None:  # fmt: skip
        self.store = store
        self.metadata = metadata  # the safetensors metadata of every version (a LoRA adapter's config)
        self.dtype = dtype  # of the floating tensors published (LearnerConfig.publish_dtype, resolved)
        self.run_id = run_id
        self.keep_versions = keep_versions
        self.version = 0  # the newest version stored and announced
        self.key: str | None = None  # ...and its key
        self.reported = 0  # samples_consumed last reported on the progress topic
        self.reported_at = 0.0  # ...and when (monotonic)
        self.on_report: Callable[[int, int], None] | None = None  # called with (version, samples consumed) per report
        self._weights: Publisher[WeightsAnnouncement] | None = None
        self._progress: Publisher[LearnerProgress] | None = None
        self._in_flight: asyncio.Task | None = None

    def connect(self, weights: Publisher[WeightsAnnouncement], progress: Publisher[LearnerProgress]) -> None:
        """The topics' publishers (the learner service's clients)."""
        self._weights, self._progress = weights, progress

    async def publish(self, state: dict, version: int, step: int) -> None:
        """Store and announce ``state`` (``Trainer.weights()``'s tensors) as ``version``, then prune."""
        from safetensors.torch import save

        data = await asyncio.to_thread(lambda: save(cast(state, self.dtype), metadata=self.metadata))
        key = keys.weights_key(self.run_id, version)
        info = await asyncio.to_thread(self.store.put, key, data)
        announcement = WeightsAnnouncement(run_id=self.run_id, version=version, key=key, uri=self.store.uri(key),
                                           sha256=info.sha256 or "", step=step)  # fmt: skip
        await self._weights.publish_and_wait(announcement, key=self.run_id)
        self.version, self.key = version, key
        await asyncio.to_thread(self.prune)

    async def report(self, progress: dict) -> None:
        """Publish ``progress`` (``LearnerProgress``'s fields) on the progress topic."""
        await self._progress.publish_and_wait(LearnerProgress(run_id=self.run_id, **progress), key=self.run_id)
        if self.on_report is not None:
            self.on_report(progress["policy_version"], progress["samples_consumed"])
        self.reported, self.reported_at = progress["samples_consumed"], time.monotonic()

    def start(self, state: dict | None, version: int, step: int, progress: dict) -> None:
        """Begin a step's publication: its weights (``state``; None: a step that does not publish),
        then its progress report. The one before must have been waited for."""
        if self._in_flight is not None:
            raise RuntimeError("a step publication is in flight: wait for it first")
        self._in_flight = asyncio.create_task(self._step(state, version, step, progress))

    async def _step(self, state: dict | None, version: int, step: int, progress: dict) -> None:
        if state is not None:
            await self.publish(state, version, step)
        await self.report(progress)

    async def wait(self) -> None:
        """Wait for the step publication in flight, if any (its error, if it failed, is raised here)."""
        task, self._in_flight = self._in_flight, None
        if task is not None:
            await task

    async def cancel(self) -> None:
        """Abandon the step publication in flight, if any."""
        task, self._in_flight = self._in_flight, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def versions(self) -> list[int]:
        """The versions in the object store, oldest first."""
        found = (keys.weights_version(i.key) for i in self.store.list(keys.weights_prefix(self.run_id)))
        return sorted(v for v in found if v is not None)

    def latest(self) -> int:
        """The newest version in the object store (0: none)."""
        return max(self.versions(), default=0)

    def prune(self) -> None:
        """Delete the versions but the newest ``keep_versions``."""
        for old in self.versions()[: -self.keep_versions]:
            self.store.delete(keys.weights_key(self.run_id, old))
