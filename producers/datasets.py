"""A run config's ``data:`` section as the producer's task stream.

Every file is loaded and checked at start (a bad record refuses the start, naming file, line
and field, unless ``data.on_error`` is ``skip``), so a run never stops halfway through its data
on a record it could have refused at once. Tasks get what their records do not carry from the
run config: the group size (``producer.group_size``) and the sampling (``sampling``).

Epochs re-issue every task with ``attempt`` set to the pass: rollout ids derive from task id,
sample index and attempt, so each pass's rollouts are new ones, trained on exactly once like the
first pass's, and a redelivered task of one pass is still recognised as a duplicate.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import structlog

from conveyor.config import RunConfig
from conveyor.contracts import SamplingParams, Task
from conveyor.errors import ConfigError
from conveyor.images import ImageKeeper
from conveyor.objectstore import open_object_store
from producers.loaders import RecordError, RecordRejected, TaskFileError, TaskLoader, resolve_mapping

log = structlog.get_logger(__name__)


@dataclass
class Dataset:
    """The tasks of a run's data files (one split), ready to stream."""

    tasks: list[Task]
    records: int = 0
    rejected: list[RecordError] = field(default_factory=list)
    held_out: list[Task] = field(default_factory=list)  # tasks of the other split (the evaluator's)


def load_dataset(cfg: RunConfig) -> Dataset:
    """Load and check every file of ``cfg.data``; raises ConfigError naming what is wrong.
    Images in the records are checked and stored in the run's object store as they load."""
    data = cfg.data
    if not data.files:
        raise ConfigError("data.files: no files to load")
    try:
        mapping = resolve_mapping(data.mapping, preset=data.preset)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"data.mapping: {exc}") from None
    if mapping.default_group_size < 2:
        # the record's own group size wins; the run's fills in where it has none
        mapping = mapping.model_copy(update={"default_group_size": cfg.producer.group_size})
    defaults = SamplingParams(**cfg.sampling.model_dump())
    out = Dataset(tasks=[])
    seen: dict[str, str] = {}
    put_image = ImageKeeper(lambda: open_object_store(cfg.object_store))
    for path in data.files:
        try:
            loader = TaskLoader(path, cfg.run_id, mapping, data.on_error, put_image=put_image)
            tasks = list(loader)
        except TaskFileError as exc:
            raise ConfigError(f"data.files: {exc}") from None
        except RecordRejected as exc:
            raise ConfigError(f"data.files: {exc} (data.on_error: skip to skip such records)") from None
        out.records += loader.records
        out.rejected.extend(loader.errors)
        for task in tasks:
            if task.task_id in seen:
                raise ConfigError(f"data.files: task id {task.task_id!r} of {path} is also in {seen[task.task_id]}")
            seen[task.task_id] = str(path)
            if task.split != data.split:
                out.held_out.append(task if task.sampling is not None else msgspec.structs.replace(task, sampling=defaults))
                continue
            if task.group_size < 2:
                raise ConfigError(
                    f"data.files: task {task.task_id!r} of {path} has group_size {task.group_size}: "
                    "GRPO needs at least 2 samples per group"
                )
            out.tasks.append(task if task.sampling is not None else msgspec.structs.replace(task, sampling=defaults))
    if not out.tasks:
        raise ConfigError(f"data.files: no {data.split} tasks in {len(data.files)} file(s) ({out.records} records)")
    for err in out.rejected:
        log.warning("producer.record_rejected", error=str(err))
    log.info(
        "producer.dataset_loaded",
        tasks=len(out.tasks),
        records=out.records,
        rejected=len(out.rejected),
        held_out=len(out.held_out),
    )
    return out


def epochs(cfg: RunConfig, dataset: Dataset) -> Iterator[Task]:
    """``data.epochs`` passes over the tasks, each in a new order (``data.shuffle_seed``)."""
    rng = random.Random(cfg.data.shuffle_seed)
    for epoch in range(cfg.data.epochs):
        order = list(dataset.tasks)
        if cfg.data.shuffle_seed is not None:
            rng.shuffle(order)
        for task in order:
            yield msgspec.structs.replace(task, attempt=epoch) if epoch else task
