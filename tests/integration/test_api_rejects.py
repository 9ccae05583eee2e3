"""The producer's HTTP API, served by uvicorn over TCP against the stack's Kafka-protocol broker,
refuses a battery of bad requests, each with a 4xx naming the field, and then still accepts a
valid submission from the same process: no request can take it down or make it answer 5xx.

Prints ``FIGURE api_rejects <refused as specified>/<cases>``."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import pytest

from conveyor.config import ProducerConfig, RunConfig
from conveyor.contracts import LearnerProgress, Task, decode, encode
from conveyor.topics import Topics
from conveyor.transport import open_transport
from producers.build import build_api

TOKEN = "battery-token-" + "a" * 24
LIMITED = "limited-token-" + "b" * 24  # a second token, spent by the rate-limit case
BURST = 100


def task(**over) -> dict:
    return {"prompt": "2 + 2 =", "verifier": {"kind": "math", "data": {"answer": "4"}}, **over}


def nested(depth: int):
    v: object = 1
    for _ in range(depth):
        v = {"n": v}
    return v


@pytest.fixture
def api(kafka_cfg, tmp_path, monkeypatch):
    """(base url, run id, image root): uvicorn serving build_api's app in a thread of its own."""
    root, outside = tmp_path / "images", tmp_path / "outside"
    (root / "py311").mkdir(parents=True)
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    pc = ProducerConfig(
        suite=None,
        max_batch=50,
        max_prompt_chars=1000,
        max_messages=8,
        max_message_chars=1000,
        max_verifier_data_bytes=4096,
        max_metadata_entries=8,
        max_metadata_chars=64,
        max_tokens_limit=4096,
        image_roots=[str(root)],
        rate_limit_per_s=1.0,
        rate_limit_burst=BURST,
    )
    monkeypatch.setenv("CONVEYOR_API_TOKENS", f"{TOKEN},{LIMITED}")
    cfg = RunConfig(transport=kafka_cfg, producer=pc)
    import uvicorn

    holder: dict = {}

    async def serve() -> None:
        transport = open_transport(kafka_cfg)
        server = uvicorn.Server(
            uvicorn.Config(build_api(cfg, transport), host="127.0.0.1", port=0, log_config=None, access_log=False)
        )
        holder["server"] = server
        try:
            await server.serve()
        finally:
            await transport.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (holder.get("server") and holder["server"].started):
        assert thread.is_alive() and time.monotonic() < deadline, "the API did not start"
        time.sleep(0.05)
    port = holder["server"].servers[0].sockets[0].getsockname()[1]
    run_id = f"rejects-{uuid.uuid4().hex[:8]}"
    yield f"http://127.0.0.1:{port}", run_id, root
    holder["server"].should_exit = True
    thread.join(timeout=15)


def battery(run_id: str, root) -> list[tuple[str, str, str, dict, int, list]]:
    """(name, method, path, request kwargs, status, loc prefix the detail must name)."""
    tasks = f"/v1/runs/{run_id}/tasks"
    body = ["body", "tasks", 0]
    sampling = [*body, "sampling"]
    data = [*body, "verifier", "data"]
    raw = {"headers": {"Content-Type": "application/json"}}

    def bad(name: str, t: dict, loc: list, status: int = 422):
        return (name, "POST", tasks, {"json": {"tasks": [t]}}, status, loc)

    def literal(name: str, text: str, loc: list):
        return (name, "POST", tasks, {"content": text.encode(), **raw}, 422, loc)

    auth = ["header", "authorization"]
    return [
        ("auth-missing", "POST", tasks, {"json": {"tasks": [task()]}, "headers": {"Authorization": None}}, 401, auth),
        ("auth-wrong", "POST", tasks, {"json": {"tasks": [task()]}, "headers": {"Authorization": "Bearer guess"}}, 401, auth),
        ("auth-scheme", "GET", f"/v1/runs/{run_id}/status", {"headers": {"Authorization": f"Basic {TOKEN}"}}, 401, auth),
        ("malformed-json", "POST", tasks, {"content": b'{"tasks": [', **raw}, 422, ["body"]),
        ("not-an-object", "POST", tasks, {"json": [1, 2]}, 422, ["body"]),
        ("no-tasks", "POST", tasks, {"json": {"tasks": []}}, 422, ["body", "tasks"]),
        ("too-many-tasks", "POST", tasks, {"json": {"tasks": [task()] * 51}}, 413, ["body", "tasks"]),
        ("body-50MB", "POST", tasks, {"content": b"x" * (50 << 20), **raw}, 413, ["body"]),
        bad("extra-field", task(colour="red"), [*body, "colour"]),
        bad("wrong-type-group-size", task(group_size="4"), [*body, "group_size"]),
        bad("wrong-type-prompt", task(prompt=5), [*body, "prompt"]),
        bad("missing-verifier", {"prompt": "x"}, [*body, "verifier"]),
        bad("unknown-verifier-kind", task(verifier={"kind": "astrology"}), [*body, "verifier", "kind"]),
        bad("prompt-and-messages", task(messages=[{"role": "user", "content": "x"}]), body),
        bad("bad-task-id", task(task_id="a b"), [*body, "task_id"]),
        bad("bad-split", task(split="test"), [*body, "split"]),
        bad("prompt-too-long", task(prompt="x" * 1001), [*body, "prompt"]),
        bad("too-many-messages", {**task(prompt=None), "messages": [{"role": "user", "content": "x"}] * 9}, [*body, "messages"]),
        bad(
            "message-too-long",
            {**task(prompt=None), "messages": [{"role": "user", "content": "x" * 1001}]},
            [*body, "messages", 0, "content"],
        ),  # fmt: skip
        bad("verifier-data-too-large", task(verifier={"kind": "math", "data": {"answer": "4" * 5000}}), data),
        bad("verifier-data-too-deep", task(verifier={"kind": "math", "data": nested(33)}), data),
        literal("body-nested-100k", '{"tasks": [' + "[" * 100_000 + "]" * 100_000 + "]}", ["body"]),
        bad("metadata-too-many", task(metadata={f"k{i}": "v" for i in range(9)}), [*body, "metadata"]),
        bad("metadata-value-too-long", task(metadata={"k": "v" * 65}), [*body, "metadata", "k"]),
        bad("stop-too-many", task(sampling={"stop": [f"s{i}" for i in range(17)]}), [*sampling, "stop"]),
        bad("stop-string-too-long", task(sampling={"stop": ["s" * 1001]}), [*sampling, "stop", 0]),
        bad("group-size-over-limit", task(group_size=65), [*body, "group_size"]),
        bad("max-tokens-over-limit", task(sampling={"max_tokens": 4097}), [*sampling, "max_tokens"]),
        bad("top-p-zero", task(sampling={"top_p": 0}), [*sampling, "top_p"]),
        bad("temperature-negative", task(sampling={"temperature": -0.5}), [*sampling, "temperature"]),
        literal(
            "nan-literal",
            '{"tasks": [{"prompt": "x", "verifier": {"kind": "math"}, "sampling": {"temperature": NaN}}]}',
            [*sampling, "temperature"],
        ),  # fmt: skip
        literal(
            "infinity-literal",
            '{"tasks": [{"prompt": "x", "verifier": {"kind": "math", "data": {"v": -Infinity}}}]}',
            [*data, "v"],
        ),  # fmt: skip
        literal(
            "float-overflow", '{"tasks": [{"prompt": "x", "verifier": {"kind": "math", "data": {"v": 1e999}}}]}', [*data, "v"]
        ),
        literal("lone-surrogate", '{"tasks": [{"prompt": "\\ud800", "verifier": {"kind": "math"}}]}', [*body, "prompt"]),
        literal(
            "lone-surrogate-key",
            '{"tasks": [{"prompt": "x", "verifier": {"kind": "math"}, "metadata": {"\\udfff": "v"}}]}',
            [*body, "metadata"],
        ),  # fmt: skip
        literal(
            "huge-int",
            '{"tasks": [{"prompt": "x", "verifier": {"kind": "math"}, "priority": 1' + "0" * 40 + "}]}",
            [*body, "priority"],
        ),  # fmt: skip
        bad("int-over-64-bits", task(sampling={"seed": 2**64}), [*sampling, "seed"]),
        bad("image-outside-roots", task(verifier={"kind": "terminal", "data": {"image": "/etc"}}), [*data, "image"]),
        bad("image-dotdot", task(verifier={"kind": "terminal", "data": {"image": f"{root}/../outside"}}), [*data, "image"]),
        bad("image-symlink-escape", task(verifier={"kind": "terminal", "data": {"image": f"{root}/escape"}}), [*data, "image"]),
        bad("image-relative", task(verifier={"kind": "terminal", "data": {"image": "images/py311"}}), [*data, "image"]),
        ("bad-run-id", "POST", "/v1/runs/bad%20id!/tasks", {"json": {"tasks": [task()]}}, 422, ["path", "run_id"]),
        ("unknown-run", "POST", "/v1/runs/no-such-run/tasks", {"json": {"tasks": [task()]}}, 404, ["path", "run_id"]),
        ("create-bad-run-id", "POST", "/v1/runs", {"json": {"run_id": "../etc"}}, 422, ["body", "run_id"]),
        ("status-bad-run-id", "GET", "/v1/runs/a.b/status", {}, 422, ["path", "run_id"]),
    ]


def names_field(response: httpx.Response, loc: list) -> bool:
    try:
        detail = response.json()["detail"]
    except (ValueError, KeyError):
        return False
    return isinstance(detail, list) and any(d["loc"][: len(loc)] == loc and d["msg"] for d in detail)


def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(api, kafka_cfg):
    base, run_id, root = api
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get("/healthz").status_code == 200  # probes need no token
        assert http.post("/v1/runs", json={"run_id": run_id}, headers=auth).status_code == 201

        cases, failures = battery(run_id, root), []
        for name, method, path, kw, status, loc in cases:
            headers = {**auth, **kw.get("headers", {})}
            kw = {**kw, "headers": {k: v for k, v in headers.items() if v is not None}}
            try:
                r = http.request(method, path, **kw)
            except httpx.HTTPError as exc:  # e.g. the connection dropped: not an answer
                failures.append(f"{name}: {type(exc).__name__}")
                continue
            if r.status_code != status or not names_field(r, loc):
                failures.append(f"{name}: {r.status_code} {r.text[:200]}")
            elif status == 401 and r.headers.get("www-authenticate") != "Bearer":
                failures.append(f"{name}: no WWW-Authenticate: Bearer")

        limited = {"Authorization": f"Bearer {LIMITED}"}
        codes = [http.get("/v1/runs/a.b/status", headers=limited).status_code for _ in range(BURST)]
        r = http.get("/v1/runs/a.b/status", headers=limited)
        rate_ok = (
            r.status_code == 429 and int(r.headers.get("retry-after", 0)) >= 1 and names_field(r, ["header", "authorization"])
        )
        cases.append(("rate-limited", "", "", {}, 429, []))
        if not (rate_ok and set(codes) == {422}):
            failures.append(f"rate-limited: {set(codes)} then {r.status_code} {r.text[:200]}")

        refused = len(cases) - len(failures)
        print(f"FIGURE api_rejects {refused}/{len(cases)}")
        assert not failures, "\n".join(failures)

        # Same process, no restart: a valid submission at the limits is accepted and on the topic.
        good = task(
            task_id=f"ok-{uuid.uuid4().hex[:6]}",
            prompt="p" * 1000,
            group_size=64,
            sampling={"temperature": 0, "top_p": 1, "max_tokens": 4096, "stop": ["s"] * 16},
            metadata={f"k{i}": "v" * 64 for i in range(8)},
            verifier={"kind": "terminal", "data": {"image": f"{root}/py311", "checks": "def test(): pass"}},
        )
        r = http.post(f"/v1/runs/{run_id}/tasks", json={"tasks": [good]}, headers=auth)
        assert r.status_code == 202, r.text
        on_topic = asyncio.run(read_topic(kafka_cfg, Topics(run_id).tasks))
        assert [decode(v, Task).task_id for v in on_topic] == [good["task_id"]]
        assert decode(on_topic[0], Task).sampling.temperature == 0  # greedy

        # A record on the progress topic that is not a LearnerProgress does not break the status.
        asyncio.run(publish_progress(kafka_cfg, run_id))
        r = http.get(f"/v1/runs/{run_id}/status", headers=auth)
        assert r.status_code == 200 and r.json()["learner"] == {"samples_consumed": 32, "policy_version": 2, "step": 2}, r.text
        assert r.json()["tasks_accepted_here"] == 1


async def read_topic(kafka_cfg, topic: str) -> list[bytes]:
    transport = open_transport(kafka_cfg)
    reader = transport.consumer([topic], None)
    await reader.start()
    try:
        out: list[bytes] = []
        for _ in range(20):
            out += [r.value for r in await reader.getmany(timeout_s=0.5)]
            if out and await reader.caught_up():
                return out
        return out
    finally:
        await reader.close()
        await transport.close()


async def publish_progress(kafka_cfg, run_id: str) -> None:
    transport = open_transport(kafka_cfg)
    producer = transport.producer()
    await producer.start()
    try:
        topic = Topics(run_id).progress
        await producer.send_and_wait(
            topic, encode(LearnerProgress(run_id=run_id, samples_consumed=32, policy_version=2, step=2)), b"k"
        )
        await producer.send_and_wait(topic, b"\xc1 not msgpack", run_id.encode())
    finally:
        await producer.close()
        await transport.close()
