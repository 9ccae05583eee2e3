"""The producer API's guard rails, in memory: token bucket, bearer tokens, start-up refusal off
loopback, image roots, errors that reveal nothing, the status route's broker use, and the client's
retry rules (a 4xx is never retried). The full battery of bad requests is
tests/integration/test_api_rejects.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conveyor.client import ApiError, ConveyorClient
from conveyor.config import ProducerConfig, parse_run_config
from conveyor.contracts import LearnerProgress, encode
from conveyor.errors import ConfigError
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryBroker, MemoryTransport
from producers.api import create_app
from producers.api_limits import TokenBucket, image_error, resolved_roots
from producers.build import build_api

TOKEN = "t0k3n-" + "a" * 26
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GOOD = {"task_id": "t-1", "prompt": "2 + 2 =", "verifier": {"kind": "math", "data": {"answer": "4"}}}


async def call(app, method, path, headers=AUTH, **kw):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
        return await c.request(method, path, headers=headers, **kw)


# --------------------------------------------------------------------------
# token bucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_allows_a_burst_then_paces_each_key_on_its_own():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=2.0, burst=3, clock=clock)
    assert [bucket.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take("a") == pytest.approx(0.5)  # one token refills in 1 / rate seconds
    assert bucket.take("b") == 0.0  # another token's bucket is full
    clock.now += 0.5
    assert bucket.take("a") == 0.0 and bucket.take("a") > 0
    clock.now += 60  # refills up to the burst, never beyond it
    assert [bucket.take("a") for _ in range(4)][-1] > 0


def test_rate_limited_requests_get_429_with_retry_after():
    app = create_app(MemoryTransport(MemoryBroker()), ProducerConfig(suite=None, rate_limit_per_s=0.1, rate_limit_burst=2))

    async def go():
        codes = [(await call(app, "GET", "/v1/runs/r/status")).status_code for _ in range(2)]
        r = await call(app, "GET", "/v1/runs/r/status")
        assert codes == [404, 404] and r.status_code == 429
        assert int(r.headers["retry-after"]) >= 9 and r.json()["detail"][0]["loc"] == ["header", "authorization"]
        assert (await call(app, "GET", "/healthz")).status_code == 200  # probes are never limited

    asyncio.run(go())


# --------------------------------------------------------------------------
# tokens and start-up


def test_every_route_but_health_and_metrics_needs_a_configured_token():
    app = create_app(MemoryTransport(MemoryBroker()), tokens=["other-token-" + "b" * 20, TOKEN])

    async def go():
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"}):
            r = await call(app, "POST", "/v1/runs", headers=headers, json={"run_id": "r1"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert (await call(app, "POST", "/v1/runs", json={"run_id": "r1"})).status_code == 201  # the second token
        assert (await call(app, "GET", "/healthz", headers={})).status_code == 200
        metrics = await call(app, "GET", "/metrics", headers={})
        assert metrics.status_code == 200 and 'conveyor_api_responses_total{status="401"} 3.0' in metrics.text

    asyncio.run(go())


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "producer.internal"])
def test_the_api_refuses_to_start_beyond_loopback_without_tokens(monkeypatch, host):
    monkeypatch.delenv("CONVEYOR_API_TOKENS", raising=False)
    cfg = parse_run_config({"producer": {"http_host": host}})
    with pytest.raises(ConfigError, match="producer.http_host"):
        build_api(cfg, MemoryTransport(MemoryBroker()))
    monkeypatch.setenv("CONVEYOR_API_TOKENS", f"{TOKEN}, second-token-{'c' * 20}")
    assert build_api(cfg, MemoryTransport(MemoryBroker())) is not None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"])
def test_loopback_may_serve_without_tokens(monkeypatch, host):
    monkeypatch.delenv("CONVEYOR_API_TOKENS", raising=False)
    assert build_api(parse_run_config({"producer": {"http_host": host}}), MemoryTransport(MemoryBroker())) is not None


def test_short_tokens_and_inconsistent_limits_are_config_errors(monkeypatch):
    monkeypatch.delenv("CONVEYOR_API_TOKENS", raising=False)
    monkeypatch.setenv("API_TOKENS_X", "short")
    cfg = parse_run_config({"producer": {"api_tokens_env": "API_TOKENS_X"}})
    with pytest.raises(ConfigError, match="producer.api_tokens_env"):
        build_api(cfg, MemoryTransport(MemoryBroker()))
    with pytest.raises(ConfigError, match="max_group_size"):
        parse_run_config({"producer": {"group_size": 128}})
    with pytest.raises(ConfigError, match="image_roots"):
        parse_run_config({"producer": {"image_roots": ["relative/images"]}})
    with pytest.raises(ConfigError, match="producer.max_body_bytes"):
        kafka = {"type": "kafka", "bootstrap_servers": "127.0.0.1:1", "max_request_bytes": 2 << 20}
        build_api(parse_run_config({"transport": kafka, "producer": {"max_body_bytes": 4 << 20}}), None)


def test_max_tokens_is_capped_by_the_engines_model_length(monkeypatch):
    monkeypatch.delenv("CONVEYOR_API_TOKENS", raising=False)
    cfg = parse_run_config({"rollout": {"engine": "vllm", "vllm": {"max_model_len": 2048}}})
    app = build_api(cfg, MemoryTransport(MemoryBroker()))

    async def go():
        await call(app, "POST", "/v1/runs", json={"run_id": "r"})
        ok = await call(app, "POST", "/v1/runs/r/tasks", json={"tasks": [{**GOOD, "sampling": {"max_tokens": 2048}}]})
        over = await call(app, "POST", "/v1/runs/r/tasks", json={"tasks": [{**GOOD, "sampling": {"max_tokens": 2049}}]})
        assert ok.status_code == 202 and over.status_code == 422
        assert over.json()["detail"][0]["loc"] == ["body", "tasks", 0, "sampling", "max_tokens"]

    asyncio.run(go())


# --------------------------------------------------------------------------
# limits as functions


def test_image_paths_resolve_before_the_roots_are_checked(tmp_path):
    root, outside = tmp_path / "images", tmp_path / "outside"
    (root / "py311").mkdir(parents=True)
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    roots = resolved_roots([str(root)])
    assert image_error(str(root / "py311"), roots) is None
    assert "image_roots" in image_error(str(root / "escape"), roots)  # a symlink out of the root
    assert "'..'" in image_error(f"{root}/../outside", roots)
    assert "absolute" in image_error("images/py311", roots)
    assert "image_roots" in image_error("/etc", roots)
    assert image_error({"path": "/etc"}, roots) is not None
    assert "empty" in image_error(str(root / "py311"), [])


def test_the_api_takes_the_reward_workers_image_roots_when_it_has_none_of_its_own(monkeypatch, tmp_path):
    monkeypatch.delenv("CONVEYOR_API_TOKENS", raising=False)
    (tmp_path / "py311").mkdir()
    app = build_api(parse_run_config({"reward": {"image_roots": [str(tmp_path)]}}), MemoryTransport(MemoryBroker()))

    async def go():
        await call(app, "POST", "/v1/runs", json={"run_id": "r"})
        for image, status in ((str(tmp_path / "py311"), 202), ("/etc", 422)):
            t = {**GOOD, "verifier": {"kind": "terminal", "data": {"image": image, "checks": "def test(): pass"}}}
            r = await call(app, "POST", "/v1/runs/r/tasks", json={"tasks": [t]})
            assert r.status_code == status, r.text

    asyncio.run(go())


# --------------------------------------------------------------------------
# failures reveal nothing, status reads without groups or admin clients


class FailingSends(MemoryTransport):
    def producer(self):
        p = super().producer()

        async def send(*_a, **_kw):
            raise RuntimeError("SASL password=hunter2 at kafka-0.internal:9092")

        p.send = send
        return p


class CountingTransport(MemoryTransport):
    listings = 0

    async def list_topics(self):
        self.listings += 1
        return await super().list_topics()


def test_broker_failures_and_bugs_answer_without_their_exception_text(monkeypatch):
    app = create_app(FailingSends(MemoryBroker()), tokens=[TOKEN])

    async def go():
        await call(app, "POST", "/v1/runs", json={"run_id": "r"})
        r = await call(app, "POST", "/v1/runs/r/tasks", json={"tasks": [GOOD]})
        assert r.status_code == 503 and "retry" in r.text and "hunter2" not in r.text and "kafka-0" not in r.text
        monkeypatch.setattr("producers.api.to_task", lambda *a: 1 / 0)
        r = await call(app, "POST", "/v1/runs/r/tasks", json={"tasks": [GOOD]})
        assert r.status_code == 500 and "division" not in r.text
        assert r.json()["request_id"] == r.headers["x-request-id"]

    asyncio.run(go())


def test_status_skips_undecodable_progress_and_opens_no_group_or_listing_per_request():
    transport = CountingTransport(MemoryBroker())
    app = create_app(transport, tokens=[TOKEN])
    progress = Topics("r").progress

    async def go():
        await call(app, "POST", "/v1/runs", json={"run_id": "r"})
        p = transport.producer()
        await p.send_and_wait(progress, encode(LearnerProgress(run_id="r", samples_consumed=64, policy_version=3, step=4)), b"r")
        await p.send_and_wait(progress, b"\x93not a progress record", b"r")
        for _ in range(20):
            r = await call(app, "GET", "/v1/runs/r/status")
            assert r.status_code == 200 and r.json()["learner"] == {"samples_consumed": 64, "policy_version": 3, "step": 4}
        await p.send_and_wait(progress, encode(LearnerProgress(run_id="r", samples_consumed=128, policy_version=5, step=8)), b"r")
        assert (await call(app, "GET", "/v1/runs/r/status")).json()["learner"]["step"] == 8
        assert transport.broker.groups == {}  # readers only: no consumer group per request
        assert transport.listings == 0  # the run was created here: known without asking the broker
        for _ in range(20):
            assert (await call(app, "GET", "/v1/runs/unknown/status")).status_code == 404
        assert transport.listings <= 2  # unknown runs share one listing per second

    asyncio.run(go())


# --------------------------------------------------------------------------
# the client


def scripted(responses: list[httpx.Response], seen: list[httpx.Request]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return responses.pop(0)

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("status", [400, 401, 404, 413, 422])
def test_the_client_never_retries_a_4xx_and_says_why(monkeypatch, status):
    monkeypatch.setattr("conveyor.client.time.sleep", lambda s: pytest.fail("slept before a permanent error"))
    detail = [{"loc": ["body", "tasks", 0, "prompt"], "msg": "prompt length 9 exceeds the limit of 8", "type": "too_long"}]
    seen: list = []
    client = ConveyorClient(
        "http://p", token=TOKEN, transport=scripted([httpx.Response(status, json={"detail": detail})] * 3, seen)
    )
    with pytest.raises(ApiError) as info:
        client.submit("r", [GOOD])
    assert len(seen) == 1 and info.value.permanent and info.value.status == status
    assert "body.tasks.0.prompt: prompt length 9 exceeds" in str(info.value)
    assert seen[0].headers["authorization"] == f"Bearer {TOKEN}"


def test_the_client_retries_429_after_retry_after_and_503_then_succeeds(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("conveyor.client.time.sleep", slept.append)
    responses = [
        httpx.Response(429, headers={"Retry-After": "7"}, json={"detail": []}),
        httpx.Response(503, json={"detail": "the broker did not answer; retry"}),
        httpx.Response(202, json={"accepted": 1}),
    ]
    seen: list = []
    monkeypatch.setenv("CONVEYOR_API_TOKENS", f" {TOKEN} ,other-token-{'d' * 20}")
    client = ConveyorClient("http://p", transport=scripted(responses, seen))
    assert client.submit("r", [GOOD]) == {"accepted": 1}
    assert slept == [7.0, 1.0] and len(seen) == 3
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in seen)  # the env's first token


def test_the_client_gives_up_after_its_retries(monkeypatch):
    monkeypatch.setattr("conveyor.client.time.sleep", lambda s: None)
    seen: list = []
    client = ConveyorClient("http://p", token=TOKEN, retries=2, transport=scripted([httpx.Response(503, text="busy")] * 3, seen))
    with pytest.raises(ApiError) as info:
        client.status("r")
    assert info.value.status == 503 and not info.value.permanent and len(seen) == 3
