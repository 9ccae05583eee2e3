"""The reward service's section of the run config: sandbox limits, Celery task limits, the
verifier kinds users register and the LLM judges the ``judge`` verifier asks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from conveyor.backend_config import Secret, _Section


class JudgeConfig(_Section):
    """One OpenAI-compatible chat endpoint that grades completions (``tasks/judge.py``)."""

    url: str
    """The API's base URL, e.g. ``http://judge:8000/v1``."""
    model: str
    api_key: Secret = SecretStr("EMPTY")
    """Read from ``CONVEYOR_REWARD__JUDGES__<NAME>__API_KEY`` rather than the file, where it is a secret."""
    max_concurrency: int = Field(8, ge=1, le=1024)
    """Requests in flight at once, per reward process."""
    timeout_s: float = Field(15.0, gt=0)
    """One request's time limit."""
    max_retries: int = Field(2, ge=0, le=20)
    """Retries of a request that failed for the endpoint's reasons (connection, 429, 5xx), with
    exponential backoff; past them the sample scores ``error``."""
    temperature: float = Field(0.0, ge=0)
    max_tokens: int = Field(256, ge=1)
    score_min: float = 0.0
    score_max: float = 10.0
    """The score scale the rubric asks for; the reward is the score mapped onto [0, 1]."""
    pass_at: float = Field(0.5, ge=0, le=1)
    """A reward at or above it counts as a pass."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Passed as is with every request: what the endpoint offers beyond OpenAI's API, e.g. vLLM's
    ``{"structured_outputs": {"regex": "..."}}`` to hold the answer to the score format."""
    cache_size: int = Field(100_000, ge=0)
    """Verdicts kept per reward process by (judge, rubric, prompt, completion); 0: none."""

    @model_validator(mode="after")
    def _scale(self) -> JudgeConfig:
        if not self.score_min < self.score_max:
            raise ValueError("need score_min < score_max")
        return self


class RewardConfig(_Section):
    """Sandbox limits per execution and the Celery task's own limits."""

    timeout_s: float = Field(2.0, gt=0, le=3600)
    """Wall-clock limit of one program or command in the sandbox."""
    memory_mb: int = Field(256, ge=32)
    max_output_bytes: int = Field(8192, ge=256)
    tmp_mb: int = Field(16, ge=1)
    nproc: int = Field(64, ge=4)
    cgroups: Literal["auto", "required", "off"] = "auto"
    queue: str = "conveyor.reward"
    soft_time_limit_s: float = Field(60.0, gt=0)
    hard_time_limit_s: float = Field(90.0, gt=0)
    max_tasks_per_child: int = Field(10_000, ge=1)
    """Tasks a Celery pool process runs before it is replaced (bounds whatever leaks). Celery's pool
    maintenance starts the replacement up to 5 s later, and a worker of concurrency 1 scores nothing
    meanwhile: at 500, in a distributed run at ~57 tasks/s per worker, that is a third of its time."""
    max_retries: int = Field(5, ge=0)
    """Retries of infrastructure failures (the sandbox could not run); the model's own failures are results."""
    worker_concurrency: int = Field(2, ge=1, le=256)
    result_timeout_s: float = Field(600.0, gt=0)
    """How long the bridge waits for a task's result before it scores the rollout ``infra`` (dropped by
    the learner). A task that a worker started and left without a result past ``hard_time_limit_s``
    (the worker died) is submitted again well before this."""

    batch_size: int = Field(64, ge=1, le=4096)
    """Rollouts per Celery task for the kinds scored in the worker's process (math, tool calls,
    reward models, judges, users' functions); sandbox kinds go one per task. 1: one per task."""
    verifier_timeout_s: float = Field(60.0, gt=0)
    """Wall-clock limit of one call of a user's verifier function (a batch of samples) in the
    in-process scorer; its samples score ``error`` past it. On Celery workers the task's soft
    time limit interrupts the function instead."""
    environments: dict[str, str] = Field(default_factory=dict)
    """Users' environments for multi-turn agents, ``{name: "module:Class"}`` (``tasks/environments.py``);
    every role registers them at start (the rollout worker drives them, the reward service replays them)."""
    tools: dict[str, str] = Field(default_factory=dict)
    """The code behind the tools tasks bring, ``{name: "module:function"}`` (``tasks/tool_env.py``):
    what the ``tools`` environment executes when the model calls a task's tool of that name."""
    judges: dict[str, JudgeConfig] = Field(default_factory=dict)
    """The LLM judges the ``judge`` verifier may ask, by name (``tasks/judge.py``): the operator's
    endpoints; a task names one (``verifier.data.judge``, default ``default``), never a URL."""
    queues: dict[str, str] = Field(default_factory=dict)
    """Verifier kind -> Celery queue of its own (``{reward_model: conveyor.reward-rm}``), so the workers
    that score it (``conveyor serve reward-worker --queue ...``) scale apart from the sandbox workers."""
    verifiers: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    """Users' verifier kinds: ``{kind: "module:function"}`` or ``{kind: {fn, style, required, pass_at}}``
    (``tasks/registry.py``); every service registers them at start."""
    image_roots: list[str] = Field(default_factory=list)
    """Absolute host directories a terminal task's ``verifier.data.image`` must resolve inside (``sandbox/images.py``);
    empty: no task may name one. ``producer.image_roots`` refuses a submitted image earlier; this is the worker's check."""

    @field_validator("image_roots")
    @classmethod
    def _image_roots(cls, v: list[str]) -> list[str]:
        if any(not r.startswith("/") or ".." in r.split("/") or not r.strip("/.") for r in v):
            raise ValueError("each image root must be an absolute path, not /, without '..'")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> RewardConfig:
        if not self.timeout_s < self.soft_time_limit_s < self.hard_time_limit_s:
            raise ValueError("need timeout_s < soft_time_limit_s < hard_time_limit_s")
        for name, judge in self.judges.items():
            # A judge that cannot answer must be given up on before the Celery task is interrupted:
            # an interrupted batch is retried whole, and its other samples with it.
            if judge.timeout_s * (judge.max_retries + 1) >= self.soft_time_limit_s:
                raise ValueError(f"judges.{name}: timeout_s x (max_retries + 1) must stay below soft_time_limit_s "
                                 f"({judge.timeout_s:g} x {judge.max_retries + 1} >= {self.soft_time_limit_s:g})")  # fmt: skip
        return self
