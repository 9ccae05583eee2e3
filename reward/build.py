"""The reward service as a run config describes it: its scorer (the sandbox in this process, or
Celery workers) and the bridge from the rollouts topic to the scored topic. ``conveyor serve``,
the demo and the tests all build it here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from conveyor.config import RunConfig
from conveyor.messaging import claim_check_for
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.transport.base import Transport
from reward.bridge import RewardBridge
from reward.scorers import CeleryScorer, LocalScorer


def scorer(cfg: RunConfig) -> LocalScorer | CeleryScorer:
    """The reward service as ``celery`` names it: ``local`` scores in this process's sandbox."""
    if cfg.celery.type == "local":
        from sandbox.runner import Sandbox

        return LocalScorer(Sandbox.from_config(cfg.reward), fn_timeout_s=cfg.reward.verifier_timeout_s)
    from reward.celery_app import make_app

    return CeleryScorer(make_app(cfg), result_timeout_s=cfg.reward.result_timeout_s, queues=cfg.reward.queues,
                        batch_size=cfg.reward.batch_size)  # fmt: skip


def decoder(path: Path) -> Callable[[list[int]], str]:
    """Token ids -> text with the model's tokenizer (a model directory or its tokenizer.json)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def build(
    cfg: RunConfig,
    transport: Transport,
    topics: Topics,
    *,
    scorer: LocalScorer | CeleryScorer,
    decode: Callable[[list[int]], str],
    store: ObjectStore | None = None,
) -> RewardBridge:
    """``store``: where claim-checked rollouts are read from (and large verdicts written to)."""
    return RewardBridge(transport, topics, scorer, decode, cfg.bridge, claim_check=claim_check_for(cfg, store))
