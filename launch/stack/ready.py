"""Waiting for a server process the stack started to answer over HTTP."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


class NotReady(RuntimeError):
    """The process exited, or did not answer in time; the message ends with its log's tail."""


def wait_http_ready(proc: subprocess.Popen, url: str, within_s: float, *, name: str, log_tail: Callable[[], str],
                    every_s: float = 0.2) -> None:  # fmt: skip
    """Until ``url`` answers 200; raises :class:`NotReady` if ``proc`` exits or ``within_s`` passes
    (the caller stops the process)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotReady(f"{name} exited {proc.returncode}: {log_tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(every_s)
    raise NotReady(f"{name} not ready in {within_s:g} s: {log_tail()}")
