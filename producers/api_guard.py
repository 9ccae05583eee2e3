"""The producer API's front door: who may call it, how often, how much, and what a failure reveals.

An ASGI middleware (:class:`Guard`), outermost of the app's own, acting before routing and before
the body is read, so a stranger's 50 MB upload costs a header check, not 50 MB of memory:

1. bearer token (``Authorization: Bearer <token>``, compared in constant time against every
   configured token): 401 with ``WWW-Authenticate: Bearer``. ``/healthz`` and ``/metrics``
   stay open for probes and scrapers; they reveal counts, never tasks.
2. rate limit per token (:class:`producers.api_limits.TokenBucket`): 429 with ``Retry-After``;
   without tokens (loopback only) every client shares one bucket.
3. body size: a declared ``Content-Length`` over the cap is refused unread, a streamed body is
   counted as it arrives; 413 either way.
4. an exception nothing else handled: 500 with a request id, never the exception's text (which can
   carry broker addresses, paths or the request's data); the detail goes to the log under that id.

Every response carries ``X-Request-ID``. :func:`api_tokens` and :func:`require_tokens_off_loopback`
read and check the tokens at start-up.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import os
import uuid
from collections import Counter
from collections.abc import Sequence

import structlog
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.config import ProducerConfig
from conveyor.errors import ConfigError
from producers.api_limits import TokenBucket, error

log = structlog.get_logger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/metrics"})
MIN_TOKEN_CHARS = 16


def api_tokens(pc: ProducerConfig, environ: dict[str, str] | None = None) -> list[str]:
    """The bearer tokens in ``pc.api_tokens_env`` (comma-separated); ConfigError for a token too
    short to resist guessing."""
    raw = (os.environ if environ is None else environ).get(pc.api_tokens_env, "")
    tokens = [t.strip() for t in raw.split(",") if t.strip()]
    if any(len(t) < MIN_TOKEN_CHARS or not t.isascii() for t in tokens):
        raise ConfigError(
            f"producer.api_tokens_env: every token in ${pc.api_tokens_env} must be at least {MIN_TOKEN_CHARS} "
            "ASCII characters (e.g. `openssl rand -hex 32`)"
        )
    return tokens


def is_loopback(host: str) -> bool:
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname may resolve to anything


def require_tokens_off_loopback(pc: ProducerConfig, tokens: Sequence[str]) -> None:
    """An API reachable beyond this machine may create runs and flood the tasks topic: it needs tokens."""
    if not tokens and not is_loopback(pc.http_host):
        raise ConfigError(
            f"producer.http_host: {pc.http_host!r} is reachable beyond loopback, and no API token is configured: "
            f"set ${pc.api_tokens_env} (comma-separated bearer tokens; in Kubernetes from a Secret) "
            "or bind 127.0.0.1"
        )


def _reject(status: int, errors: list[dict], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": errors}, status_code=status, headers=headers)


class Guard:
    """See the module docstring. ``counts`` tallies responses by status (for ``/metrics``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: Sequence[str],
        bucket: TokenBucket | None,
        max_body_bytes: int,
        counts: Counter | None = None,
    ) -> None:
        self.app = app
        self._tokens = [t.encode() for t in tokens]
        self._bucket = bucket
        self._max_body = max_body_bytes
        self.counts = counts if counts is not None else Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex[:16]
        started = False

        async def tagged_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counts[message["status"]] += 1
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            refusal, receive = await self._screen(scope, receive)
            if refusal is not None:
                await refusal(scope, receive, tagged_send)
                return
            await self.app(scope, receive, tagged_send)
        except _ClientLeft:
            return
        except Exception:  # noqa: BLE001 - the last line: log it whole, answer without it
            log.exception("api.unexpected_error", request_id=request_id, method=scope.get("method"), path=scope.get("path"))
            if not started:
                body = {
                    "detail": "internal error; the operator can find it in the log by its request_id",
                    "request_id": request_id,
                }
                await JSONResponse(body, status_code=500)(scope, receive, tagged_send)

    async def _screen(self, scope: Scope, receive: Receive) -> tuple[JSONResponse | None, Receive]:
        if scope["path"] in OPEN_PATHS:
            return None, receive
        headers = dict(scope["headers"])
        key = "anonymous"
        if self._tokens:
            index = self._match(headers.get(b"authorization"))
            if index is None:
                why = "a bearer token is required" if b"authorization" not in headers else "the bearer token is not valid"
                refusal = _reject(401, [error(["header", "authorization"], why, "unauthorized")], {"WWW-Authenticate": "Bearer"})
                return refusal, receive
            key = f"token-{index}"
        if self._bucket is not None and (wait := self._bucket.take(key)) > 0:
            after = max(1, math.ceil(wait))
            msg = (
                f"rate limit exceeded ({self._bucket.rate:g} requests/s, bursts of {self._bucket.burst}, per token); "
                f"retry after {after} s"
            )
            return _reject(429, [error(["header", "authorization"], msg, "rate_limited")], {"Retry-After": str(after)}), receive
        return await self._read_body(headers, receive)

    def _match(self, header: bytes | None) -> int | None:
        scheme, _, given = (header or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        given = given.strip()
        match = None
        for i, token in enumerate(self._tokens):  # every token compared: timing says nothing of which matched
            if hmac.compare_digest(given, token):
                match = i
        return match

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> tuple[JSONResponse | None, Receive]:
        too_large = _reject(
            413,
            [error(["body"], f"the request body exceeds producer.max_body_bytes ({self._max_body} bytes)", "too_large")],
            {"Connection": "close"},
        )
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return _reject(400, [error(["header", "content-length"], "not a byte count", "value_error")]), receive
            if int(declared) > self._max_body:
                return too_large, receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientLeft
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body:
                return too_large, receive
            chunks.append(chunk)
            if not message.get("more_body", False):
                return None, _replay(b"".join(chunks), receive)


class _ClientLeft(Exception):
    """The client disconnected before its body was read: there is no one to answer."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then defers to the server's."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
