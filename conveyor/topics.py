"""Topic names and the message type each topic carries.

Topics are namespaced per run: ``conveyor.<run_id>.<kind>``, so several runs
share one broker without seeing each other's traffic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.contracts import (
    Admission,
    DeadLetter,
    Heartbeat,
    LearnerProgress,
    Message,
    Rollout,
    ScoredRollout,
    Task,
    WeightsAnnouncement,
)

if TYPE_CHECKING:
    from conveyor.transport.base import TopicSpec

TOPIC_KINDS: dict[str, type[Message]] = {
    "tasks": Task,
    "rollouts": Rollout,
    "scored": ScoredRollout,
    "weights": WeightsAnnouncement,
    "progress": LearnerProgress,
    "admissions": Admission,
    "dead-letter": DeadLetter,
    "heartbeats": Heartbeat,
}

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def validate_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ValueError(
            f"run_id {run_id!r} must be 1-64 characters of letters, digits, '_' or '-', starting with a letter or digit"
        )
    return run_id


@dataclass(frozen=True)
class Topics:
    """The topic names of one run."""

    run_id: str
    prefix: str = "conveyor"

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)

    def name(self, kind: str) -> str:
        if kind not in TOPIC_KINDS:
            raise KeyError(f"unknown topic kind {kind!r}; known: {', '.join(TOPIC_KINDS)}")
        return f"{self.prefix}.{self.run_id}.{kind}"

    @property
    def tasks(self) -> str:
        return self.name("tasks")

    @property
    def rollouts(self) -> str:
        return self.name("rollouts")

    @property
    def scored(self) -> str:
        return self.name("scored")

    @property
    def weights(self) -> str:
        return self.name("weights")

    @property
    def progress(self) -> str:
        return self.name("progress")

    @property
    def admissions(self) -> str:
        return self.name("admissions")

    @property
    def dead_letter(self) -> str:
        return self.name("dead-letter")

    @property
    def heartbeats(self) -> str:
        return self.name("heartbeats")

    def all(self) -> list[str]:
        return [self.name(kind) for kind in TOPIC_KINDS]

    def group(self, role: str) -> str:
        """The consumer group of a role in this run (``conveyor.<run_id>.<role>``): runs that share a
        broker share no group, so one run's dead members never stall another's rebalance."""
        return f"{self.prefix}.{self.run_id}.{role}"

    def shared_specs(self) -> list[TopicSpec]:
        """The single-partition topics every instance reads whole (weights, progress, admissions)."""
        return [s for s in self.specs(1) if s.name in (self.weights, self.progress, self.admissions)]

    def specs(self, partitions: int) -> list[TopicSpec]:
        """What to create for a run: data topics with ``partitions`` partitions; one partition
        for ``weights`` and ``progress`` (keyed by run_id, one writer), ``admissions`` (a ledger
        every reader must see in one order) and ``heartbeats`` (a few messages a second);
        ``weights`` compacted so a new worker reads the latest version first."""
        from conveyor.transport.base import TopicSpec

        single = {"weights", "progress", "admissions", "heartbeats"}
        return [
            TopicSpec(self.name(kind), 1 if kind in single else partitions, compacted=kind == "weights") for kind in TOPIC_KINDS
        ]


def message_type_of(topic: str) -> type[Message] | None:
    """The message type a topic carries, from its last name component."""
    kind = topic.rsplit(".", 1)[-1]
    return TOPIC_KINDS.get(kind)
