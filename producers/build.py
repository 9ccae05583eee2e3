"""The producer as a run config describes it: the built-in suite's stream within the pipeline's
credits, and the HTTP API for services that submit their own tasks. ``conveyor serve producer``,
the demo and the tests build them here."""

from __future__ import annotations

from collections.abc import Iterator

from conveyor.config import RunConfig
from conveyor.contracts import Task
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.transport.base import Transport
from producers.producer import TaskProducer


def build(
    cfg: RunConfig, transport: Transport, topics: Topics, store: ObjectStore | None, *, tasks: Iterator[Task] | None = None
) -> TaskProducer | None:
    """A producer of ``tasks``, or of the config's suite (None when neither names any)."""
    pc = cfg.producer
    curriculum = None
    if tasks is None:
        if not pc.suite:
            return None
        from producers.sources import suite_stream, suite_tasks

        if pc.curriculum:
            from producers.curriculum import Curriculum, CurriculumConfig

            curriculum = Curriculum(
                suite_tasks(pc.suite, cfg.run_id, pc.group_size),
                CurriculumConfig(seed=pc.seed, min_hard_fraction=pc.min_hard_fraction),
            )
            tasks = curriculum
        else:
            tasks = suite_stream(pc.suite, cfg.run_id, pc.group_size, seed=pc.seed, max_tasks=pc.max_tasks)
    return TaskProducer(
        transport,
        topics,
        tasks,
        learner_batch_samples=cfg.learner.batch_groups * pc.group_size,
        store=store,
        curriculum=curriculum,
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
