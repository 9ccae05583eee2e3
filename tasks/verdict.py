"""What a verifier says of one completion."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.contracts import Feedback


@dataclass(frozen=True)
class Verdict:
    reward: float
    verdict: str
    """pass, fail, error (the task's or the verifier's fault), infra (nothing was judged), or the
    sandbox's own (timeout, memory, output_limit)."""
    feedback: Feedback | None = None
    details: dict[str, float] = field(default_factory=dict)
