"""The producer as a run config describes it: the task source (the user's data files, or a built-in
suite) streamed within the pipeline's credits, and the HTTP API for services that submit their own
tasks. ``conveyor serve producer``, the demo and the tests build them here."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from conveyor.config import RunConfig
from conveyor.contracts import Task
from conveyor.errors import ConfigError
from conveyor.messaging import claim_check_for
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
    from conveyor.images import ImageKeeper
    from conveyor.objectstore import open_object_store
    from producers.sources import suite_stream, suite_tasks

    put_image = ImageKeeper(lambda: open_object_store(cfg.object_store))  # suites that draw pictures keep them here
    if pc.curriculum:
        from producers.curriculum import Curriculum, CurriculumConfig

        curriculum = Curriculum(
            suite_tasks(pc.suite, cfg.run_id, pc.group_size, put_image),
            CurriculumConfig(seed=pc.seed, min_hard_fraction=pc.min_hard_fraction),
        )
        return TaskSource(curriculum, curriculum)
    stream = suite_stream(pc.suite, cfg.run_id, pc.group_size, seed=pc.seed, max_tasks=pc.max_tasks, put_image=put_image)
    return TaskSource(stream)


def build(cfg: RunConfig, transport: Transport, topics: Topics, store: ObjectStore | None, source: TaskSource) -> TaskProducer:
    """A producer of ``source`` (see :func:`task_source`)."""
    return TaskProducer(
        transport,
        topics,
        source.tasks,
        learner_batch_samples=cfg.learner.batch_groups * cfg.producer.group_size,
        store=store,
        curriculum=source.curriculum,
        claim_check=claim_check_for(cfg, store),
    )


def api_tokens(cfg: RunConfig) -> list[str]:
    """The HTTP API's bearer tokens, after the start-up checks: ConfigError when ``producer.http_host``
    is reachable beyond loopback and no token is configured (``producer.api_tokens_env``), or when a
    body the API accepts could make a task larger than the broker accepts. Call it before opening
    the transport, so a bad config exits 2 at once."""
    from producers.api_guard import api_tokens as tokens_in_env
    from producers.api_guard import require_tokens_off_loopback

    pc = cfg.producer
    tokens = tokens_in_env(pc)
    require_tokens_off_loopback(pc, tokens)
    broker_limit = getattr(cfg.transport, "max_request_bytes", None)
    if broker_limit is not None and pc.max_body_bytes > broker_limit - (64 << 10):
        raise ConfigError(
            f"producer.max_body_bytes ({pc.max_body_bytes}) must stay 64 KiB below transport.max_request_bytes "
            f"({broker_limit}): one submitted task could otherwise be too large to publish"
        )
    return tokens


def build_api(cfg: RunConfig, transport: Transport, store: ObjectStore | None = None):
    """The producer's HTTP API (a FastAPI app) for this run config; raises ConfigError as
    :func:`api_tokens` does."""
    from producers.api import create_app

    tokens = api_tokens(cfg)
    pc = cfg.producer
    if not pc.image_roots and cfg.reward.image_roots:  # the reward workers' own allow-list
        pc = pc.model_copy(update={"image_roots": cfg.reward.image_roots})
    engine_limit = cfg.rollout.vllm.max_model_len  # prompt and completion share it
    return create_app(
        transport,
        pc,
        partitions=getattr(cfg.transport, "partitions", 4),
        tokens=tokens,
        max_tokens=min(pc.max_tokens_limit, engine_limit) if engine_limit else pc.max_tokens_limit,
        store=store,
    )
