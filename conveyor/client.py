"""A Python client for the producer's HTTP API.

    from conveyor.client import ConveyorClient
    with ConveyorClient("http://producer:8600", token="...") as c:   # or $CONVEYOR_API_TOKENS
        c.create_run("exp-1")
        c.submit("exp-1", [{"task_id": "t1", "prompt": "2+2=", "verifier": {"kind": "math", "data": {"answer": "4"}}}])
        print(c.status("exp-1"))

Errors raise :class:`ApiError` with the status code and the server's detail (for 4xx, the list
of bad fields, rendered ``loc: msg`` in the message). A 4xx says the request itself is wrong
(bad token, bad field, too large): it is raised at once and never retried, since the same bytes
would be refused again. 408, 429 (after the server's ``Retry-After``), 503 and connection errors
are retried with backoff: give tasks a ``task_id`` so a retried batch does not create new tasks.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

TOKENS_ENV = "CONVEYOR_API_TOKENS"
RETRYABLE = frozenset({408, 429, 503})
MAX_RETRY_AFTER_S = 60.0


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {_reason(detail)}")
        self.status = status
        self.detail = detail

    @property
    def permanent(self) -> bool:
        """A 4xx other than 408/429: the request can never succeed as it is."""
        return 400 <= self.status < 500 and self.status not in RETRYABLE


def _reason(detail: Any) -> str:
    if isinstance(detail, list) and all(isinstance(d, dict) and "loc" in d for d in detail):
        return "; ".join(f"{'.'.join(map(str, d['loc']))}: {d.get('msg', '')}" for d in detail)
    return str(detail)


def _detail(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text
    return body.get("detail", body) if isinstance(body, dict) else body


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return min(max(float(response.headers["retry-after"]), 0.0), MAX_RETRY_AFTER_S)
    except (KeyError, ValueError):
        return None  # absent, or an HTTP date: the backoff decides


class ConveyorClient:
    """``token``: the bearer token; None takes the first of ``$CONVEYOR_API_TOKENS`` (the variable
    the producer reads its tokens from), or sends none."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if token is None:
            token = next((t.strip() for t in os.environ.get(TOKENS_ENV, "").split(",") if t.strip()), None)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers, transport=transport)
        self.retries = retries

    def _call(self, method: str, path: str, **kw) -> Any:
        delay = 0.5
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            wait = delay
            try:
                r = self._http.request(method, path, **kw)
            except httpx.TransportError:
                if last:
                    raise
            else:
                if r.status_code < 400:
                    return r.json()
                if r.status_code not in RETRYABLE or last:
                    raise ApiError(r.status_code, _detail(r))
                wait = _retry_after(r) or delay
            time.sleep(wait)
            delay = min(delay * 2, 10)
        raise AssertionError("unreachable")

    def create_run(self, run_id: str) -> dict:
        return self._call("POST", "/v1/runs", json={"run_id": run_id})

    def submit(self, run_id: str, tasks: list[dict]) -> dict:
        return self._call("POST", f"/v1/runs/{run_id}/tasks", json={"tasks": tasks})

    def status(self, run_id: str) -> dict:
        return self._call("GET", f"/v1/runs/{run_id}/status")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ConveyorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
