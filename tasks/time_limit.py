"""A wall-clock limit on a call of users' code (a verifier function, a tool) in a trusted process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Hung(Exception):
    """The call did not return within its limit."""


def within(call: Callable[[], T], timeout_s: float | None, name: str = "user-call") -> T:
    """``call()``, or :class:`Hung` after ``timeout_s``. A Python thread cannot be stopped: a hung
    call runs on in its daemon thread, and the caller goes on without it (on a Celery worker the
    task's soft time limit interrupts the function instead, and the pool process is recycled)."""
    if timeout_s is None:
        return call()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Hung(f"did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
