"""Limits every message obeys wherever it enters (the HTTP API, a topic, the reward service)."""

from __future__ import annotations

from typing import Any

MAX_DATA_DEPTH = 32
"""Deepest nesting of free-form payloads (``verifier.data``, tool-call arguments). Deeper values
are refused where they enter: Celery pickles the payload, and ~900 levels overflow the recursion
limit in the reward worker; no verifier needs more than a few levels."""
MAX_ABS_REWARD = 1e6
"""Largest reward magnitude a scored rollout may carry. Group advantages divide by the group's
standard deviation: a reward near the float limit overflows it and turns the step into NaNs, and
no verifier, reward model or judge scores anywhere near this."""
MAX_GROUP_SIZE = 1024
RECENT_IDS = 100_000
"""How many recent ids a long-lived reader remembers: the learner the rollout ids it trained on
(its guard against training one twice), an admission ledger reader the attempts claimed. Memory
stays flat however long the run; a redelivery older than this is treated as new."""


def nesting_depth(value: Any, limit: int = MAX_DATA_DEPTH) -> int:
    """Depth of nested containers in ``value`` (a scalar is 0), counted without recursion and
    stopping one level past ``limit`` (so a hostile payload costs no more than the limit)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((c, depth) for c in children)
    return deepest


def check_depth(value: Any, field: str, limit: int = MAX_DATA_DEPTH) -> None:
    if nesting_depth(value, limit) > limit:
        raise ValueError(f"{field} is nested deeper than {limit} levels")
