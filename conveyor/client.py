"""A Python client for the producer's HTTP API.

    from conveyor.client import ConveyorClient
    with ConveyorClient("http://producer:8600") as c:
        c.create_run("exp-1")
        c.submit("exp-1", [{"task_id": "t1", "prompt": "2+2=", "verifier": {"kind": "math", "data": {"answer": "4"}}}])
        print(c.status("exp-1"))

Errors raise :class:`ApiError` with the status code and the server's detail
(for 422, the list of bad fields). ``submit`` retries 503s and connection
errors with backoff: give tasks a ``task_id`` so a retried batch does not
create new tasks.
"""

from __future__ import annotations

import time
from typing import Any

import httpx


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class ConveyorClient:
    def __init__(self, base_url: str, *, timeout_s: float = 30.0, retries: int = 5) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self.retries = retries

    def _call(self, method: str, path: str, *, retry: bool = False, **kw) -> Any:
        delay = 0.5
        for attempt in range(self.retries + 1 if retry else 1):
            try:
                r = self._http.request(method, path, **kw)
            except httpx.TransportError:
                if not retry or attempt == self.retries:
                    raise
            else:
                if r.status_code < 400:
                    return r.json()
                detail = r.json().get("detail") if r.headers.get("content-type", "").startswith("application/json") else r.text
                if not (retry and r.status_code == 503 and attempt < self.retries):
                    raise ApiError(r.status_code, detail)
            time.sleep(delay)
            delay = min(delay * 2, 10)
        raise AssertionError("unreachable")

    def create_run(self, run_id: str) -> dict:
        return self._call("POST", "/v1/runs", json={"run_id": run_id})

    def submit(self, run_id: str, tasks: list[dict]) -> dict:
        return self._call("POST", f"/v1/runs/{run_id}/tasks", json={"tasks": tasks}, retry=True)

    def status(self, run_id: str) -> dict:
        return self._call("GET", f"/v1/runs/{run_id}/status")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ConveyorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
