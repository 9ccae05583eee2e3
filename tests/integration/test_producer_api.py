"""The producer's HTTP API over the in-memory transport: 2xx only once the tasks
are on the tasks topic; bad requests get a 4xx naming the field."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conveyor.contracts import Task, decode
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryBroker, MemoryTransport
from producers.api import create_app

GOOD = {"task_id": "t-1", "prompt": "2 + 2 =", "verifier": {"kind": "math", "data": {"answer": "4"}}, "group_size": 4}


@pytest.fixture
def api():
    transport = MemoryTransport(MemoryBroker(), partitions=2)
    app = create_app(transport, partitions=2, default_group_size=8, max_batch=5)
    return transport, app


async def call(app, method, path, **kw):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
        return await c.request(method, path, **kw)


async def tasks_on_topic(transport, run_id):
    consumer = transport.consumer([Topics(run_id).tasks], "check")
    await consumer.start()
    out = [decode(r.value, Task) for r in await consumer.getmany(timeout_s=0.1, max_records=1000)]
    await consumer.close()
    return out


def test_submitted_tasks_are_on_the_topic_when_the_2xx_comes(api):
    transport, app = api

    async def go():
        assert (await call(app, "POST", "/v1/runs", json={"run_id": "exp-1"})).status_code == 201
        chat = {"messages": [{"role": "user", "content": "hi"}], "verifier": {"kind": "math", "data": {"answer": "1"}}}
        r = await call(app, "POST", "/v1/runs/exp-1/tasks", json={"tasks": [GOOD, chat]})
        assert r.status_code == 202 and r.json()["accepted"] == 2
        tasks = await tasks_on_topic(transport, "exp-1")
        assert {t.task_id for t in tasks} == set(r.json()["task_ids"])
        by_id = {t.task_id: t for t in tasks}
        assert by_id["t-1"].group_size == 4 and by_id["t-1"].verifier.data == {"answer": "4"}
        other = next(t for t in tasks if t.task_id != "t-1")
        assert other.messages[0].content == "hi" and other.group_size == 8  # the default
        status = (await call(app, "GET", "/v1/runs/exp-1/status")).json()
        assert status["tasks_accepted_here"] == 2

    asyncio.run(go())


@pytest.mark.parametrize(
    "task,field",
    [
        ({**GOOD, "verifier": {"kind": "astrology"}}, ["body", "tasks", 1, "verifier", "kind"]),
        ({**GOOD, "group_size": 0}, ["body", "tasks", 1, "group_size"]),
        ({**GOOD, "messages": [{"role": "user", "content": "x"}]}, ["body", "tasks", 1]),
        ({**GOOD, "colour": "red"}, ["body", "tasks", 1, "colour"]),
        ({**GOOD, "prompt": ""}, ["body", "tasks", 1, "prompt"]),
    ],
    ids=["unknown-verifier", "group-size", "prompt-and-messages", "unknown-field", "empty-prompt"],
)
def test_invalid_tasks_get_422_naming_the_field_and_nothing_is_published(api, task, field):
    transport, app = api

    async def go():
        await call(app, "POST", "/v1/runs", json={"run_id": "exp-2"})
        r = await call(app, "POST", "/v1/runs/exp-2/tasks", json={"tasks": [GOOD, task]})
        assert r.status_code == 422
        assert any(d["loc"][: len(field)] == field for d in r.json()["detail"]), r.json()
        assert await tasks_on_topic(transport, "exp-2") == []  # all or nothing

    asyncio.run(go())


def test_unknown_run_bad_run_id_and_too_many_tasks(api):
    _, app = api

    async def go():
        assert (await call(app, "POST", "/v1/runs/nope/tasks", json={"tasks": [GOOD]})).status_code == 404
        assert (await call(app, "POST", "/v1/runs", json={"run_id": "bad id!"})).status_code == 422
        await call(app, "POST", "/v1/runs", json={"run_id": "exp-3"})
        r = await call(app, "POST", "/v1/runs/exp-3/tasks", json={"tasks": [GOOD] * 6})
        assert r.status_code == 413 and r.json()["detail"][0]["loc"] == ["body", "tasks"]
        assert (await call(app, "POST", "/v1/runs/exp-3/tasks", json={"tasks": []})).status_code == 422

    asyncio.run(go())
