"""What a verifier says of one completion, and the error a task's unusable payload raises."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.contracts import Feedback


class VerifierError(ValueError):
    """The task's verifier payload is unusable (the task's fault, not the model's)."""


@dataclass(frozen=True)
class Verdict:
    reward: float
    verdict: str
    """pass, fail, error (the task's or the verifier's fault), infra (nothing was judged), or the
    sandbox's own (timeout, memory, output_limit)."""
    feedback: Feedback | None = None
    details: dict[str, float] = field(default_factory=dict)
