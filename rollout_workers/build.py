"""A rollout worker as a run config describes it: ``conveyor serve rollout-worker``, the demo
and the tests build it here."""

from __future__ import annotations

import structlog

from conveyor.config import RolloutConfig, RunConfig
from conveyor.contracts import SamplingParams
from conveyor.messaging import claim_check_for
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.transport.base import Transport
from rollout_workers.worker import RolloutWorker

log = structlog.get_logger(__name__)


def inflight_tasks(rollout: RolloutConfig) -> int:
    """Tasks sampled at once: the config's, else what keeps each engine busy (vLLM batches
    continuously and wants many; the reference engine samples one batch at a time)."""
    return rollout.max_inflight_tasks or (64 if rollout.engine == "vllm" else rollout.tasks_per_batch)


def tool_sandbox(cfg: RunConfig):
    """A sandbox on this host for tool turns (a stateless Celery task cannot keep a workspace
    alive between turns); None, with a warning, where user namespaces are unavailable."""
    from sandbox.runner import Sandbox, SandboxUnavailable

    try:
        return Sandbox.from_config(cfg.reward)
    except SandboxUnavailable as exc:
        log.warning("rollout_worker.no_tool_sandbox", reason=str(exc))
        return None


def build(
    cfg: RunConfig,
    transport: Transport,
    topics: Topics,
    store: ObjectStore,
    *,
    engine,
    scorer=None,
    tool_sandbox=None,
    metrics=None,
) -> RolloutWorker:
    """``engine``: an opened engine (``rollout_workers.engines.open_engine``); ``scorer`` executes
    the attempts of multi-turn tasks; ``tool_sandbox`` runs terminal tasks' tool turns."""
    return RolloutWorker(
        transport,
        topics,
        engine,
        store,
        learner_batch_samples=cfg.learner.batch_groups * cfg.producer.group_size,
        max_lag=cfg.learner.max_lag,
        tasks_per_batch=cfg.rollout.tasks_per_batch,
        max_inflight_tasks=inflight_tasks(cfg.rollout),
        scorer=scorer,
        tool_sandbox=tool_sandbox,
        metrics=metrics,
        default_sampling=SamplingParams(**cfg.sampling.model_dump()),
        max_group_size=cfg.producer.max_group_size,  # the API's limit holds for every source
        max_task_claims=cfg.rollout.max_task_claims,
        claim_check=claim_check_for(cfg, store),
    )
