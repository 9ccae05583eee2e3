"""The producer's HTTP API: services submit work over HTTP, it lands on the tasks topic.

    POST /v1/runs                      {"run_id": "..."}            -> 201: the run's topics exist
    POST /v1/runs/{run_id}/tasks       {"tasks": [TaskIn, ...]}     -> 202: every task is on the tasks topic
    GET  /v1/runs/{run_id}/status                                   -> 200: accepted here, learner progress
    GET  /healthz, GET /metrics (Prometheus)                           open: no token needed

Every route but the open two needs ``Authorization: Bearer <token>`` when tokens are configured
(``producers/api_guard.py``: tokens, rate limit, body cap, errors). A 2xx is sent only after the
broker acknowledged every task of the request (``acks=all`` on Kafka), so nothing accepted is
ever lost; a request that fails half way answers 503 and the client retries — give tasks a
``task_id`` to make retries idempotent downstream (rollout ids derive from it).

A request that can never succeed answers a 4xx whose ``detail`` lists each bad field (``loc``)
and why (``producers/api_limits.py``): 401 no or wrong token, 404 unknown run, 413 too large,
422 invalid, 429 too many requests (``Retry-After``). A 5xx means: retry the same request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, TypeVar

import structlog
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from conveyor.config import ProducerConfig
from conveyor.contracts import IMAGE_PLACEHOLDER, ChatMessage, ImagePart, SamplingParams, Task, TextPart, VerifierSpec
from conveyor.messaging import Publisher
from conveyor.metrics import process_registry
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics, validate_run_id
from conveyor.tracing import headers_of, tracer
from conveyor.transport.base import Transport
from producers.api_guard import Guard
from producers.api_images import store_images
from producers.api_limits import (
    MAX_ERRORS,
    MAX_STOP,
    MAX_STOP_CHARS,
    BodyRejected,
    TokenBucket,
    error,
    parse_json,
    resolved_roots,
    task_errors,
)
from producers.api_runs import ProgressReaders, RunDirectory
from tasks import environments, registry
from tasks.function_tools import tools_problem

log = structlog.get_logger(__name__)

_OFF_LOOP_BYTES = 256 << 10


class _In(BaseModel):
    # strict: JSON's types as they are ("4" is not a group size, true is not a priority)
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPartIn(_In):
    type: Literal["text"]
    text: str


class ImageUrl(_In):
    url: str = Field(max_length=64 << 20)
    """A ``data:image/<png|jpeg|webp>;base64,...`` URL: images come with the request (the API fetches nothing)."""


class ImagePartIn(_In):
    type: Literal["image_url"]
    image_url: ImageUrl


class MessageIn(_In):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPartIn | ImagePartIn, Field(discriminator="type")]]
    """Text, or OpenAI's list of parts: ``{"type": "text", "text"}`` and ``{"type": "image_url", "image_url": {"url"}}``."""
    name: str | None = Field(None, max_length=200)

    @field_validator("content")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("an empty list of content parts")
        return v

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPartIn) else IMAGE_PLACEHOLDER for p in self.content)


class VerifierIn(_In):
    kind: str = Field(max_length=100)
    data: dict[str, Any] = Field(default_factory=dict)

    @field_validator("kind")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in registry.known():  # the built-in kinds and those the run config or packages register
            raise ValueError(f"unknown verifier kind {v!r}; known: {', '.join(registry.known())}")
        return v

    @model_validator(mode="after")
    def _environment_known(self) -> VerifierIn:
        if self.kind == "environment" and (why := environments.problem(self.data.get("environment"))) is not None:
            raise ValueError(f"data.environment: {why}")
        return self


class SamplingIn(_In):
    temperature: float = Field(1.0, ge=0, le=10)
    """0: greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(512, ge=1)
    """At most the run's engine limit (``producer.max_tokens_limit``, checked against the config)."""
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP
    )
    seed: int | None = None


class TaskIn(_In):
    task_id: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/-]+$")
    prompt: str | None = Field(None, min_length=1)
    messages: list[MessageIn] | None = Field(None, min_length=1)
    verifier: VerifierIn
    group_size: int | None = Field(None, ge=1)
    sampling: SamplingIn | None = None
    split: Literal["train", "heldout"] = "train"
    priority: int = 0
    metadata: dict[str, str] = Field(default_factory=dict)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    """Functions the model may call (OpenAI's format; ``tasks/function_tools.py``)."""

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v is not None and (why := tools_problem(v)) is not None:
            raise ValueError(why)
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> TaskIn:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (text) or messages (chat)")
        return self

    @model_validator(mode="after")
    def _environment_takes_it(self) -> TaskIn:
        """The environment's own check (its tools implemented here, its answer's verifier known)."""
        if self.verifier.kind == "environment" and (why := environments.task_problem(self.verifier.data, self.tools)):
            raise ValueError(why)
        return self


class SubmitIn(_In):
    tasks: list[TaskIn] = Field(min_length=1)


class RunIn(_In):
    run_id: str = Field(max_length=200)

    @field_validator("run_id")
    @classmethod
    def _valid(cls, v: str) -> str:
        return validate_run_id(v)


In = TypeVar("In", bound=_In)


async def read_json(request: Request) -> Any:
    """The request's body as strict JSON (see api_limits.parse_json); 422 naming each bad value."""
    raw = await request.body()
    try:
        # A large body takes a fraction of a second to check: off the event loop, so health probes
        # and other requests are still answered meanwhile.
        return parse_json(raw) if len(raw) < _OFF_LOOP_BYTES else await asyncio.to_thread(parse_json, raw)
    except BodyRejected as exc:
        raise RequestValidationError(exc.errors) from None


def validated(model: type[In], obj: Any) -> In:
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()[:MAX_ERRORS]]) from None


def _message(m: MessageIn, images: Iterator[ImagePart]) -> ChatMessage:
    if isinstance(m.content, str):
        return ChatMessage(role=m.role, content=m.content, name=m.name)
    parts = [TextPart(text=p.text) if isinstance(p, TextPartIn) else next(images) for p in m.content]
    return ChatMessage(role=m.role, content=parts, name=m.name)


def to_task(t: TaskIn, run_id: str, default_group_size: int, images: Sequence[ImagePart] = ()) -> Task:
    """``images``: the references of the task's image parts, in order (``producers/api_images.py``)."""
    refs = iter(images)
    return Task(
        task_id=t.task_id or f"api-{uuid.uuid4().hex}",
        run_id=run_id,
        prompt=t.prompt,
        messages=[_message(m, refs) for m in t.messages] if t.messages else None,
        verifier=VerifierSpec(kind=t.verifier.kind, data=t.verifier.data),
        group_size=t.group_size or default_group_size,
        sampling=SamplingParams(**t.sampling.model_dump()) if t.sampling else None,
        split=t.split,
        priority=t.priority,
        metadata=t.metadata,
        tools=t.tools,
    )


class ApiCollector:
    """The API's counts (kept by the app and its guard) as Prometheus series, read at scrape time."""

    def __init__(self, accepted: dict[str, int], responses: Counter) -> None:
        self.accepted, self.responses = accepted, responses

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        tasks = CounterMetricFamily("conveyor_api_tasks_accepted", "Tasks accepted over HTTP", labels=["run"])
        for run, n in list(self.accepted.items()):
            tasks.add_metric([run], n)
        yield tasks
        codes = CounterMetricFamily(
            "conveyor_api_responses", "HTTP responses by status (401, 413, 422, 429: refusals)", labels=["status"]
        )
        for code, n in list(self.responses.items()):
            codes.add_metric([str(code)], n)
        yield codes


def create_app(
    transport: Transport,
    producer: ProducerConfig | None = None,
    *,
    partitions: int = 4,
    default_group_size: int | None = None,
    max_batch: int | None = None,
    tokens: Sequence[str] = (),
    max_tokens: int | None = None,
    store: ObjectStore | None = None,
) -> FastAPI:
    """The API over ``transport``, limited by ``producer`` (a ProducerConfig; its defaults when None).

    ``default_group_size`` and ``max_batch`` override the section's ``group_size`` and ``max_batch``;
    ``tokens`` are the bearer tokens (none: no authentication, which :func:`producers.build.build_api`
    allows on loopback only); ``max_tokens`` caps ``sampling.max_tokens`` (default
    ``producer.max_tokens_limit``); ``store`` keeps submitted images (none: tasks with images get a 422)."""
    pc = producer or ProducerConfig(suite=None)
    overrides = {k: v for k, v in (("group_size", default_group_size), ("max_batch", max_batch)) if v is not None}
    pc = pc.model_copy(update=overrides) if overrides else pc
    max_tokens = max_tokens or pc.max_tokens_limit
    roots = resolved_roots(pc.image_roots)
    runs, progress = RunDirectory(transport), ProgressReaders(transport)
    responses: Counter = Counter()
    state: dict[str, Any] = {"producer": None, "accepted": {}}
    lock = asyncio.Lock()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await progress.close()
        if state["producer"] is not None:
            await state["producer"].close()

    app = FastAPI(title="Conveyor producer", version="1", lifespan=lifespan)
    bucket = TokenBucket(pc.rate_limit_per_s, pc.rate_limit_burst) if pc.rate_limit_per_s else None
    app.add_middleware(Guard, tokens=tokens, bucket=bucket, max_body_bytes=pc.max_body_bytes, counts=responses)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only loc, msg and type: FastAPI's default echoes the input, which may be megabytes, or
        # text (a lone surrogate) that cannot be rendered as JSON at all.
        return JSONResponse({"detail": [error(e["loc"], e["msg"], e["type"]) for e in exc.errors()]}, status_code=422)

    async def on_broker(what: str, work):
        try:
            return await work
        except Exception as exc:  # noqa: BLE001 - the client retries; the detail is for the log only
            log.error("api.broker_failed", what=what, error=str(exc)[:300])
            raise HTTPException(503, detail=f"the broker did not answer ({what}); retry") from None

    async def known_run(run_id: str) -> None:
        try:
            validate_run_id(run_id)
        except ValueError as exc:
            raise HTTPException(422, detail=[error(["path", "run_id"], str(exc), "value_error")]) from None
        if not await on_broker("list topics", runs.exists(run_id)):
            msg = f"run {run_id!r} does not exist: POST /v1/runs first"
            raise HTTPException(404, detail=[error(["path", "run_id"], msg, "not_found")])

    async def producer():
        async with lock:
            if state["producer"] is None:
                p = transport.producer()
                await p.start()
                state["producer"] = p
            return state["producer"]

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    api_metrics = ApiCollector(state["accepted"], responses)
    own = CollectorRegistry()
    own.register(api_metrics)
    served = process_registry()
    if served is not None:  # `conveyor serve producer`: on the role's metrics port too, where Prometheus scrapes
        try:
            served.register(api_metrics)
        except ValueError:  # a second API in the process: the first one's counts are served
            log.warning("api.metrics_already_registered")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(own), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/runs", status_code=201)
    async def create_run(request: Request) -> dict:
        body = validated(RunIn, await read_json(request))
        topics = Topics(body.run_id)
        await on_broker("create topics", transport.create_topics(topics.specs(partitions)))
        runs.add(body.run_id)
        return {"run_id": body.run_id, "topics": [s.name for s in topics.specs(partitions)]}

    @app.post("/v1/runs/{run_id}/tasks", status_code=202)
    async def submit(run_id: str, request: Request) -> dict:
        obj = await read_json(request)
        if isinstance(obj, dict) and isinstance(obj.get("tasks"), list) and len(obj["tasks"]) > pc.max_batch:
            # before validation: a batch of 100,000 small tasks is refused without validating each
            msg = f"at most {pc.max_batch} tasks per request (producer.max_batch)"
            raise HTTPException(413, detail=[error(["body", "tasks"], msg, "too_long")])
        body = validated(SubmitIn, obj)
        errors = [e for i, t in enumerate(body.tasks) for e in task_errors(t, ["body", "tasks", i], pc, max_tokens, roots)]
        if errors:
            raise HTTPException(422, detail=errors[:MAX_ERRORS])
        images = await store_images(body.tasks, store, pc.max_images_per_task)  # 422 naming each bad image
        await known_run(run_id)
        tasks = [to_task(t, run_id, pc.group_size, images[i]) for i, t in enumerate(body.tasks)]
        pub: Publisher[Task] = Publisher(await on_broker("start producer", producer()), Topics(run_id).tasks)

        async def publish_all() -> None:
            futures = []
            for t in tasks:  # each task's trace starts here (sampled by tracing.sample_ratio)
                with tracer().start_as_current_span(
                    "submit", attributes={"conveyor.task_id": t.task_id, "conveyor.via": "http"}
                ) as span:
                    futures.append(await pub.publish(t, t.task_id, headers_of(span)))
            await asyncio.gather(*futures)  # the 2xx waits for the broker's acknowledgement of every task

        await on_broker("acknowledge the tasks", publish_all())
        state["accepted"][run_id] = state["accepted"].get(run_id, 0) + len(tasks)
        return {"accepted": len(tasks), "task_ids": [t.task_id for t in tasks]}

    @app.get("/v1/runs/{run_id}/status")
    async def status(run_id: str) -> dict:
        await known_run(run_id)
        latest = await on_broker("read progress", progress.latest(run_id))
        learner = None if latest is None else {"samples_consumed": latest.samples_consumed, "policy_version": latest.policy_version,
                                                "step": latest.step}  # fmt: skip
        return {"run_id": run_id, "tasks_accepted_here": state["accepted"].get(run_id, 0), "learner": learner}

    return app
