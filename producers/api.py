"""The producer's HTTP API: services submit work over HTTP, it lands on the tasks topic.

    POST /v1/runs                      {"run_id": "..."}            -> 201: the run's topics exist
    POST /v1/runs/{run_id}/tasks       {"tasks": [TaskIn, ...]}     -> 202: every task is on the tasks topic
    GET  /v1/runs/{run_id}/status                                   -> 200: accepted here, learner progress
    GET  /healthz, GET /metrics (Prometheus)

A 2xx is sent only after the broker acknowledged every task of the request
(``acks=all`` on Kafka), so nothing accepted is ever lost; a request that
fails half way answers 503 and the client retries — give tasks a
``task_id`` to make retries idempotent downstream (rollout ids derive from
it). Invalid requests answer 422 naming the field (``loc``) and the reason;
an unknown run answers 404.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import asynccontextmanager
from typing import Any, Literal

import structlog
from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from conveyor.contracts import ChatMessage, LearnerProgress, SamplingParams, Task, VerifierSpec, decode
from conveyor.messaging import Publisher
from conveyor.topics import Topics, validate_run_id
from conveyor.transport.base import Transport
from tasks import registry

log = structlog.get_logger(__name__)


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MessageIn(_In):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None


class VerifierIn(_In):
    kind: str
    data: dict[str, Any] = Field(default_factory=dict)

    @field_validator("kind")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in registry.known():  # the built-in kinds and those the run config or packages register
            raise ValueError(f"unknown verifier kind {v!r}; known: {', '.join(registry.known())}")
        return v


class SamplingIn(_In):
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(512, ge=1, le=1_000_000)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None


class TaskIn(_In):
    task_id: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/-]+$")
    prompt: str | None = Field(None, min_length=1)
    messages: list[MessageIn] | None = Field(None, min_length=1)
    verifier: VerifierIn
    group_size: int | None = Field(None, ge=1, le=1024)
    sampling: SamplingIn | None = None
    split: Literal["train", "heldout"] = "train"
    priority: int = 0
    metadata: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_prompt(self) -> TaskIn:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (text) or messages (chat)")
        return self


class SubmitIn(_In):
    tasks: list[TaskIn] = Field(min_length=1)


class RunIn(_In):
    run_id: str

    @field_validator("run_id")
    @classmethod
    def _valid(cls, v: str) -> str:
        return validate_run_id(v)


def to_task(t: TaskIn, run_id: str, default_group_size: int) -> Task:
    return Task(
        task_id=t.task_id or f"api-{uuid.uuid4().hex}",
        run_id=run_id,
        prompt=t.prompt,
        messages=[ChatMessage(**m.model_dump()) for m in t.messages] if t.messages else None,
        verifier=VerifierSpec(kind=t.verifier.kind, data=t.verifier.data),
        group_size=t.group_size or default_group_size,
        sampling=SamplingParams(**t.sampling.model_dump()) if t.sampling else None,
        split=t.split,
        priority=t.priority,
        metadata=t.metadata,
    )


def create_app(transport: Transport, *, partitions: int = 4, default_group_size: int = 8, max_batch: int = 1000) -> FastAPI:
    state: dict[str, Any] = {"producer": None, "accepted": {}}
    lock = asyncio.Lock()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        if state["producer"] is not None:
            await state["producer"].close()

    app = FastAPI(title="Conveyor producer", version="1", lifespan=lifespan)

    async def producer():
        async with lock:
            if state["producer"] is None:
                p = transport.producer()
                await p.start()
                state["producer"] = p
            return state["producer"]

    async def run_exists(run_id: str) -> bool:
        return Topics(run_id).tasks in await transport.list_topics()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

        reg = CollectorRegistry()
        g = Gauge("conveyor_api_tasks_accepted", "Tasks accepted over HTTP", ["run"], registry=reg)
        for run, n in state["accepted"].items():
            g.labels(run).set(n)
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/runs", status_code=201)
    async def create_run(body: RunIn) -> dict:
        topics = Topics(body.run_id)
        await transport.create_topics(topics.specs(partitions))
        return {"run_id": body.run_id, "topics": [s.name for s in topics.specs(partitions)]}

    @app.post("/v1/runs/{run_id}/tasks", status_code=202)
    async def submit(run_id: str, body: SubmitIn) -> dict:
        try:
            validate_run_id(run_id)
        except ValueError as exc:
            raise HTTPException(422, detail=[{"loc": ["path", "run_id"], "msg": str(exc), "type": "value_error"}]) from None
        if len(body.tasks) > max_batch:
            raise HTTPException(413, detail=[{"loc": ["body", "tasks"], "msg": f"at most {max_batch} tasks per request",
                                              "type": "too_long"}])  # fmt: skip
        if not await run_exists(run_id):
            raise HTTPException(404, detail=f"run {run_id!r} does not exist: POST /v1/runs first")
        tasks = [to_task(t, run_id, default_group_size) for t in body.tasks]
        pub: Publisher[Task] = Publisher(await producer(), Topics(run_id).tasks)
        try:
            futures = [await pub.publish(t, t.task_id) for t in tasks]
            await asyncio.gather(*futures)  # the 2xx waits for the broker's acknowledgement of every task
        except Exception as exc:  # noqa: BLE001 - the client must retry; nothing was promised
            log.error("api.submit_failed", run_id=run_id, error=str(exc)[:300])
            raise HTTPException(503, detail=f"the broker did not acknowledge the tasks: {exc}; retry") from None
        state["accepted"][run_id] = state["accepted"].get(run_id, 0) + len(tasks)
        return {"accepted": len(tasks), "task_ids": [t.task_id for t in tasks]}

    @app.get("/v1/runs/{run_id}/status")
    async def status(run_id: str) -> dict:
        if not await run_exists(run_id):
            raise HTTPException(404, detail=f"run {run_id!r} does not exist")
        consumer = transport.consumer([Topics(run_id).progress], f"api-status-{uuid.uuid4().hex[:8]}")
        await consumer.start()
        latest = None
        try:
            for _ in range(3):
                for rec in await consumer.getmany(timeout_s=0.2, max_records=10_000):
                    latest = decode(rec.value, LearnerProgress)
        finally:
            await consumer.close()
        learner = None if latest is None else {"samples_consumed": latest.samples_consumed, "policy_version": latest.policy_version,
                                                "step": latest.step}  # fmt: skip
        return {"run_id": run_id, "tasks_accepted_here": state["accepted"].get(run_id, 0), "learner": learner}

    return app
