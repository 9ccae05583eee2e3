"""The producer as a run config describes it: the task source (the user's data files, or a built-in
suite) streamed within the pipeline's credits, and the HTTP API for services that submit their own
tasks. ``conveyor serve producer``, the demo and the tests build them here."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from conveyor.config import RunConfig
from conveyor.contracts import Task
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.transport.base import Transport
from producers.producer import TaskProducer


@dataclass
class TaskSource:
    tasks: Iterator[Task]
    curriculum: object | None = None  # producers.curriculum.Curriculum: it hears the scored groups


def task_source(cfg: RunConfig) -> TaskSource | None:
    """The config's data files (``data:``), else its suite (``producer.suite``); None when it
    names neither. Data files are loaded and checked here: a bad one raises ConfigError, so the
    caller refuses to start before anything is published."""
    pc = cfg.producer
    if cfg.data.files:
        from producers.datasets import epochs, load_dataset

        stream = epochs(cfg, load_dataset(cfg))
        return TaskSource(itertools.islice(stream, pc.max_tasks) if pc.max_tasks else stream)
    if not pc.suite:
        return None
    from producers.sources import suite_stream, suite_tasks

    if pc.curriculum:
        from producers.curriculum import Curriculum, CurriculumConfig

        curriculum = Curriculum(
            suite_tasks(pc.suite, cfg.run_id, pc.group_size),
            CurriculumConfig(seed=pc.seed, min_hard_fraction=pc.min_hard_fraction),
        )
        return TaskSource(curriculum, curriculum)
    return TaskSource(suite_stream(pc.suite, cfg.run_id, pc.group_size, seed=pc.seed, max_tasks=pc.max_tasks))


def build(cfg: RunConfig, transport: Transport, topics: Topics, store: ObjectStore | None, source: TaskSource) -> TaskProducer:
    """A producer of ``source`` (see :func:`task_source`)."""
    return TaskProducer(
        transport,
        topics,
        source.tasks,
        learner_batch_samples=cfg.learner.batch_groups * cfg.producer.group_size,
        store=store,
        curriculum=source.curriculum,
    )


def build_api(cfg: RunConfig, transport: Transport):
    """The producer's HTTP API (a FastAPI app) for this run config."""
    from producers.api import create_app

    pc = cfg.producer
    return create_app(
        transport,
        partitions=getattr(cfg.transport, "partitions", 4),
        default_group_size=pc.group_size,
        max_batch=pc.max_batch,
    )
