"""Process-level helpers that every service (and the demo) shares.

- :func:`retry_until`: await a start-up call until it succeeds, backing off
  (doubling, jittered) on errors the caller calls retriable, until a
  deadline; used for the broker (``transport.connect_deadline_s``) and the
  object store (``object_store.connect_deadline_s``).
- :func:`startup_frozen`: keep what start-up built (modules, the model,
  ~400k objects in a rollout worker) out of the garbage collector's full
  collections while the service runs (each would take ~0.3 s with the GIL held).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import structlog

log = structlog.get_logger(__name__)
T = TypeVar("T")


async def retry_until(
    what: str,
    fn: Callable[[], Awaitable[T]],
    deadline_s: float,
    *,
    retriable: Callable[[BaseException], bool],
    event: str,
    give_up: Callable[[BaseException, int], BaseException] = lambda exc, attempts: exc,
    first_delay_s: float = 0.1,
    max_delay_s: float = 5.0,
) -> T:
    """``await fn()`` until it returns. An error ``retriable`` accepts is logged as ``event``
    (what, attempt, delay_s, error) and retried after a jittered, doubling delay while the
    deadline allows; then ``give_up(error, attempts)`` is raised from it. Other errors
    propagate at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    delay, attempt = first_delay_s, 0
    while True:
        attempt += 1
        try:
            return await fn()
        except Exception as exc:  # noqa: BLE001 - classified by the caller
            if not retriable(exc):
                raise
            if loop.time() + delay > deadline:
                failure = give_up(exc, attempt)
                if failure is exc:
                    raise
                raise failure from exc
            log.warning(event, what=what, attempt=attempt, delay_s=round(delay, 3), error=str(exc)[:300])
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, max_delay_s)


@contextmanager
def startup_frozen() -> Iterator[None]:
    """Freeze every object alive now out of the collector's full collections (``gc.freeze``)
    for the block; unfreeze after it (native bindings report frozen objects as leaks at exit)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie child of ours counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True
