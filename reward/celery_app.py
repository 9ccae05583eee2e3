"""The Celery side of the reward service: one task scores one rollout.

Delivery guarantees, and why each setting is there:

- ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acknowledged
  only after it ran; a worker killed mid-task (OOM, kill -9, node loss)
  leaves it unacknowledged and the broker hands it to another worker
  (RabbitMQ at once when the connection drops; Redis after
  ``visibility_timeout_s``).
- ``worker_prefetch_multiplier = 1``: a worker reserves one task per process,
  so a dead worker strands at most that many and slow programs don't pile
  up behind each other.
- soft and hard time limits, both below Redis's visibility timeout (checked
  by the config), so a task is never running on two workers because the
  broker thought it lost.
- ``worker_max_tasks_per_child``: each pool process is replaced after that
  many tasks (bounded growth of whatever leaks).
- infrastructure failures (the sandbox did not report: bwrap failed, cgroup
  creation failed, the soft time limit hit) are retried with exponential
  backoff; the model's own failures (error, timeout, memory, ...) are
  results, never retries.

The task id is the rollout id, so a task executed twice stores one result
under one id and the bridge publishes one ScoredRollout for it.

Kinds scored in the worker's process (math, tool calls, reward models, judges, users' functions:
``tasks/registry.py``) travel up to ``reward.batch_size`` rollouts per task instead
(``conveyor.reward.score_many``, its id derived from the rollout ids): a trivial Python reward
costs a few microseconds, a Celery task round trip about a millisecond, and a reward model or a
judge scores a batch in one forward pass or with its requests in flight together. Kinds that run
the model's code in the sandbox stay one per task: a batch of programs that each may run to
``timeout_s`` would make the task's time limits meaningless.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import msgspec
import structlog
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_process_shutdown
from opentelemetry import trace

from conveyor.config import RabbitMQBrokerConfig, RedisBrokerConfig, RewardConfig, RunConfig
from conveyor.contracts import Task
from conveyor.errors import ConfigError
from conveyor.tracing import start_child

log = structlog.get_logger(__name__)
TASK_NAME = "conveyor.reward.score"
BATCH_TASK_NAME = "conveyor.reward.score_many"


class SandboxInfraError(RuntimeError):
    """The sandbox could not run the program (not the program's fault): retried."""


_sandbox = None
_sandbox_lock = threading.Lock()


def _worker_sandbox(reward: RewardConfig):
    """One sandbox per pool process, created after the fork."""
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            from sandbox.runner import Sandbox

            # one long-lived bwrap per pool process: ~5 ms per rollout instead of ~45
            _sandbox = Sandbox.from_config(reward, parallel=1, warm=True)
            log.info("worker_sandbox_ready", pid=os.getpid(), cgroups=_sandbox.cgroup_version)
        return _sandbox


def _close_worker_sandbox(**_kw) -> None:
    """Celery ends a pool process with ``os._exit`` right after ``worker_process_shutdown``: no
    finalizer runs, so the sandbox's directories are removed here (pool processes are recycled
    every few seconds under load)."""
    global _sandbox
    with _sandbox_lock:
        if _sandbox is not None:
            _sandbox.close()
            _sandbox = None


def verdict_to_dict(v) -> dict[str, Any]:
    return {
        "reward": v.reward,
        "verdict": v.verdict,
        "feedback": msgspec.to_builtins(v.feedback) if v.feedback is not None else None,
        "details": dict(v.details),
    }


def _tls_options(broker: RedisBrokerConfig | RabbitMQBrokerConfig, backend: str) -> dict[str, Any]:
    """Celery's TLS settings for a ``rediss://`` / ``amqps://`` broker and a ``rediss://`` result
    backend (redis-py and py-amqp name the same settings differently)."""
    import ssl

    cert_reqs = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}[broker.ssl_cert_reqs]
    files = (broker.ssl_cafile, broker.ssl_certfile, broker.ssl_keyfile)
    ca, cert, key = (str(f) if f is not None else None for f in files)
    redis_tls = {"ssl_cert_reqs": cert_reqs, "ssl_ca_certs": ca, "ssl_certfile": cert, "ssl_keyfile": key,
                 "ssl_check_hostname": cert_reqs == ssl.CERT_REQUIRED}  # fmt: skip
    out: dict[str, Any] = {}
    if broker.url.startswith("rediss://"):
        out["broker_use_ssl"] = redis_tls
    elif broker.url.startswith("amqps://"):
        amqp_tls: dict[str, Any] = {"cert_reqs": cert_reqs, "ca_certs": ca, "certfile": cert, "keyfile": key}
        if cert_reqs == ssl.CERT_REQUIRED:
            amqp_tls["server_hostname"] = None  # kombu fills in the URL's host: the certificate must name it
        out["broker_use_ssl"] = amqp_tls
    if backend.startswith("rediss://"):
        out["redis_backend_use_ssl"] = redis_tls
    return out


def make_app(cfg: RunConfig) -> Celery:
    """The reward service's Celery app. The broker and backend URLs carry the passwords (the
    config keeps them as secrets, out of its URLs); Celery and kombu mask them when they print a URL."""
    broker = cfg.celery
    if isinstance(broker, RedisBrokerConfig):
        transport_options = {
            "visibility_timeout": broker.visibility_timeout_s,
            # kombu sweeps for expired unacknowledged tasks every interval*throttle seconds
            # (default ~100 s); sweep often enough that redelivery follows the timeout.
            "unacked_restore_interval": max(1, min(10, broker.visibility_timeout_s // 4)),
            "unacked_restore_throttle": 1,
        }
    elif isinstance(broker, RabbitMQBrokerConfig):
        transport_options = {}
    else:
        raise ConfigError("celery.type is 'local': there is no broker to run Celery workers against")
    reward = cfg.reward
    backend = broker.backend_url()
    app = Celery("conveyor-reward", broker=broker.broker_url(), backend=backend, set_as_current=False)
    app.conf.update(
        **_tls_options(broker, backend),
        task_acks_late=True,
        # STARTED is stored when a worker begins a task: the bridge's scorer tells a task whose
        # worker died (started, no result past the hard limit) from one still queued.
        task_track_started=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_soft_time_limit=reward.soft_time_limit_s,
        task_time_limit=reward.hard_time_limit_s,
        worker_max_tasks_per_child=reward.max_tasks_per_child,
        worker_concurrency=reward.worker_concurrency,
        task_default_queue=reward.queue,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=3600,
        broker_transport_options=transport_options,
        result_backend_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # stderr stays the process's: the service's log lines are written to whatever sys.stderr is
        # (conveyor/logging.py), and Celery's logging proxy there would drop them as recursion.
        worker_redirect_stdouts=False,
        worker_send_task_events=False,
        task_store_errors_even_if_ignored=True,
    )

    @app.task(
        name=TASK_NAME,
        bind=True,
        autoretry_for=(SandboxInfraError, SoftTimeLimitExceeded),
        retry_backoff=1,
        retry_backoff_max=30,
        retry_jitter=True,
        max_retries=reward.max_retries,
    )
    def score(self, task: dict, completion: str, rollout_id: str) -> dict[str, Any]:
        from tasks.verifiers import score_batch

        t = msgspec.convert(task, Task)
        # The rollout's trace goes on through the task's headers (the bridge's score span).
        span = start_child("verify", {k: self.request.get(k) for k in ("traceparent", "tracestate") if self.request.get(k)},
                           **{"conveyor.rollout_id": rollout_id, "conveyor.verifier": t.verifier.kind})  # fmt: skip
        try:
            with trace.use_span(span, end_on_exit=False):  # the task's log lines carry the trace id
                [v] = score_batch(_worker_sandbox(reward), [(t, completion)])
                span.set_attribute("conveyor.verdict", v.verdict)
                if v.verdict == "infra":
                    raise SandboxInfraError(f"rollout {rollout_id}: the sandbox did not report a result")
                log.info("scored", rollout_id=rollout_id, verdict=v.verdict, reward=v.reward, attempt=self.request.retries)
        finally:
            span.end()
        return verdict_to_dict(v)

    @app.task(
        name=BATCH_TASK_NAME,
        bind=True,
        autoretry_for=(SoftTimeLimitExceeded,),
        retry_backoff=1,
        retry_backoff_max=30,
        retry_jitter=True,
        max_retries=reward.max_retries,
    )
    def score_many(self, items: list[list[Any]]) -> dict[str, dict[str, Any]]:
        """``items``: ``[task, completion, rollout_id, trace headers]`` each -> rollout id -> verdict."""
        from tasks.environments import needs_sandbox
        from tasks.registry import where
        from tasks.verifiers import score_batch

        tasks = [(msgspec.convert(t, Task), c) for t, c, _, _ in items]
        spans = [start_child("verify", h or {}, **{"conveyor.rollout_id": rid, "conveyor.verifier": t.verifier.kind})
                 for (t, _), (_, _, rid, h) in zip(tasks, items)]  # fmt: skip
        try:
            machine = any(where(t.verifier.kind) == "sandbox" or needs_sandbox(t) for t, _ in tasks)
            sandbox = _worker_sandbox(reward) if machine else None
            verdicts = score_batch(sandbox, tasks, fn_timeout_s=None)  # the soft time limit interrupts a hung function
            for span, v in zip(spans, verdicts):
                span.set_attribute("conveyor.verdict", v.verdict)
        finally:
            for span in spans:
                span.end()
        log.info("scored_batch", rollouts=len(items), attempt=self.request.retries)
        return {rid: verdict_to_dict(v) for (_, _, rid, _), v in zip(items, verdicts)}

    app.conveyor_score = score  # type: ignore[attr-defined]
    app.conveyor_score_many = score_many  # type: ignore[attr-defined]
    worker_process_shutdown.connect(_close_worker_sandbox, weak=False)
    return app


def run_worker(
    cfg: RunConfig,
    *,
    concurrency: int | None = None,
    hostname: str | None = None,
    loglevel: str = "INFO",
    queue: str | None = None,
) -> None:
    """Blocking: a Celery worker (prefork pool) consuming the reward queue (or ``queue``: one of
    ``reward.queues``, e.g. reward-model workers on GPU hosts)."""
    app = make_app(cfg)
    argv = [
        "worker",
        "--pool=prefork",
        f"--concurrency={concurrency or cfg.reward.worker_concurrency}",
        f"--queues={queue or cfg.reward.queue}",
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    if hostname:
        argv.append(f"--hostname={hostname}")
    app.worker_main(argv=argv)
