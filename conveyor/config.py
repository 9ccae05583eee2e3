"""Run configuration: one YAML file, validated by pydantic, overridable by env.

Backends are chosen by a ``type`` field (discriminated unions); unknown keys
are rejected everywhere, so a typo fails at start with the field named
instead of silently taking a default.

Environment overrides use the prefix ``CONVEYOR_`` and ``__`` between nested
fields, and win over the file::

    CONVEYOR_TRANSPORT__BOOTSTRAP_SERVERS=broker:9092 conveyor run run.yaml

Usage::

    cfg = load_run_config("examples/demo.yaml")   # raises ConfigError

The backend sections (transport, object store, Celery broker) are in ``conveyor/backend_config.py``
and importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from conveyor.backend_config import (
    CeleryBrokerConfig,
    KafkaTransportConfig,
    LocalExecutorConfig,
    LocalStoreConfig,
    MemoryTransportConfig,
    ObjectStoreConfig,
    RabbitMQBrokerConfig,
    RedisBrokerConfig,
    S3StoreConfig,
    TransportConfig,
    _Section,
)
from conveyor.observability_config import LoggingConfig, MetricsConfig, TracingConfig, TrackingConfig  # noqa: F401 - re-exported
from conveyor.reward_config import JudgeConfig, RewardConfig  # noqa: F401 - re-exported
from conveyor.rollout_config import VLLM_OWNED_ARGS, RolloutConfig, VLLMConfig  # noqa: F401 - re-exported

# The backend sections are part of the run config's interface: importable from here.
__all__ = [
    "BridgeConfig",
    "CeleryBrokerConfig",
    "ClaimCheckConfig",
    "DataConfig",
    "EvalConfig",
    "KafkaTransportConfig",
    "LearnerConfig",
    "LocalExecutorConfig",
    "LocalStoreConfig",
    "LoggingConfig",
    "MemoryTransportConfig",
    "MetricsConfig",
    "ObjectStoreConfig",
    "ProducerConfig",
    "RabbitMQBrokerConfig",
    "RedisBrokerConfig",
    "JudgeConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "S3StoreConfig",
    "SamplingDefaults",
    "SinkConfig",
    "TransportConfig",
    "VLLMConfig",
    "load_run_config",
    "parse_run_config",
    "with_overrides",
]
from conveyor.config_checks import check_run_config
from conveyor.errors import ConfigError
from conveyor.topics import validate_run_id

# --------------------------------------------------------------------------
# the services


class ProducerConfig(_Section):
    """Where tasks come from: a built-in suite and/or the HTTP API."""

    suite: str | None = "pyexpr"
    """Built-in suite to stream (pyexpr, python_functions, terminal, math_numeric, tool_calls, cad); None: HTTP only."""
    group_size: int = Field(8, ge=1, le=1024)
    max_tasks: int | None = Field(None, ge=1)
    """Stop the suite stream after this many tasks (None: endless)."""
    seed: int = 0
    http_host: str = "127.0.0.1"
    """Address the HTTP API binds; beyond loopback the producer refuses to start without API tokens."""
    http_port: int | None = Field(8600, ge=0, le=65535)
    """Serve the HTTP API here (0: any free port; None: no API)."""
    api_tokens_env: str = Field("CONVEYOR_API_TOKENS", min_length=1)
    """Environment variable with the API's bearer tokens, comma-separated (several: rotation; in Kubernetes
    from a Secret; never in this file, which is logged). Unset: no authentication, loopback only."""
    max_batch: int = Field(1000, ge=1)
    """Most tasks accepted in one HTTP submission."""
    max_body_bytes: int = Field(4 << 20, ge=1024, le=256 << 20)
    """Largest HTTP request body (413 beyond it), checked before the body is parsed."""
    max_prompt_chars: int = Field(100_000, ge=1)
    max_messages: int = Field(256, ge=1)
    max_message_chars: int = Field(100_000, ge=1)
    max_images_per_task: int = Field(16, ge=0)
    """Most images one submitted task may carry (each PNG, JPEG or WebP within conveyor/images.py's
    size limits; they are stored in the object store and travel by reference)."""
    max_verifier_data_bytes: int = Field(1 << 20, ge=1024)
    """Largest ``verifier.data`` of one task, msgpack-encoded as it travels on the tasks topic."""
    max_metadata_entries: int = Field(64, ge=0)
    max_metadata_chars: int = Field(1024, ge=1)
    max_group_size: int = Field(64, ge=2, le=1024)
    """Largest ``group_size`` a submitted task may ask for: each sample costs a generation and a scoring."""
    max_tokens_limit: int = Field(32768, ge=1)
    """Largest ``sampling.max_tokens`` accepted; lowered to ``rollout.vllm.max_model_len`` when that is set."""
    image_roots: list[str] = Field(default_factory=list)
    """Directories a submitted ``verifier.data.image`` must lie in, ``..`` and symlinks resolved (empty:
    ``reward.image_roots``; both empty: tasks naming an image are refused)."""
    rate_limit_per_s: float | None = Field(None, ge=0)
    """Requests per second per bearer token (token bucket; 429 + Retry-After beyond). None or 0: no limit."""
    rate_limit_burst: int = Field(20, ge=1)
    curriculum: bool = False
    """Schedule the suite through producers/curriculum.py (re-queue mixed, retire solved, keep hard ones coming)."""
    min_hard_fraction: float = Field(0.1, ge=0, le=1)

    @field_validator("group_size")
    @classmethod
    def _group_can_be_trained(cls, v: int) -> int:
        if v < 2:
            raise ValueError("must be >= 2: GRPO's advantages are relative to the group's mean; a group of one trains nothing")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ProducerConfig:
        if self.group_size > self.max_group_size:
            raise ValueError(f"group_size ({self.group_size}) exceeds max_group_size ({self.max_group_size})")
        if any(not r.startswith("/") or ".." in r.split("/") or not r.strip("/.") for r in self.image_roots):
            raise ValueError("image_roots must be absolute paths, not /, without '..'")
        return self


class SamplingDefaults(_Section):
    """Sampling for the tasks that carry none of their own (a task's ``sampling`` wins whole): the
    producer fills them into a data file's tasks, the rollout worker applies them to any other."""

    max_tokens: int = Field(512, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: list[str] = Field(default_factory=list)
    """Stop strings, besides the tokenizer's own end-of-sequence token."""


class DataConfig(_Section):
    """A user's dataset as the producer's source: JSONL (optionally gzipped) or Parquet files in a
    known layout (``producers/loaders``). When ``files`` is set the producer streams them instead of
    ``producer.suite``; a task without a group size gets ``producer.group_size``, one without
    sampling parameters the run's ``sampling``."""

    files: list[Path] = Field(default_factory=list)
    preset: Literal["plain", "verl", "trl"] | None = None
    """The files' layout (None: plain, or the mapping's own preset)."""
    mapping: dict[str, Any] | None = None
    """Field-mapping overrides (``producers/loaders/mapping.py``'s FieldMapping fields)."""
    split: Literal["train", "heldout"] = "train"
    """Which records the producer streams (the others are held out)."""
    epochs: int = Field(1, ge=1)
    """Passes over the data. Each pass re-issues every task with ``attempt`` = the pass, so its
    rollout ids are new and each pass is trained on exactly once."""
    shuffle_seed: int | None = 0
    """Each pass in a new order drawn from this seed (None: file order every pass)."""
    on_error: Literal["fail", "skip"] = "fail"
    """A bad record: refuse to start, naming file, line and field; or skip it (logged and counted)."""


class LoraConfig(_Section):
    """Train a LoRA adapter (PEFT) instead of every weight; each version is published as the adapter
    alone (conveyor/adapters.py), which vLLM serves as a LoRA adapter and the reference engine merges."""

    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    """Names of the linear layers to adapt (PEFT's ``target_modules``): attention by default; add
    gate_proj, up_proj, down_proj for the MLP."""
    dropout: float = Field(0.0, ge=0, lt=1)


class LearnerConfig(_Section):
    """The learner's batching, objective and durability. The learner (``learner/recipe.py``) takes this
    section whole, and its loss settings (``learner.grpo.LossConfig``) are derived from it: these are
    the learner's only defaults."""

    batch_groups: int = Field(16, ge=1)
    """Complete groups per training step."""
    max_lag: int = Field(1, ge=0)
    """Samples more than this many policy versions old are dropped (and counted), or down-weighted."""
    stale_decay: float = Field(0.0, ge=0, lt=1)
    """0: drop samples older than max_lag; in (0, 1): keep them, advantage scaled by stale_decay ** (lag - max_lag)."""
    lr: float = Field(5e-4, gt=0)
    """AdamW's learning rate (no weight decay)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps over which the learning rate rises linearly to lr (0: none)."""
    group_timeout_s: float = Field(60.0, gt=0)
    """A group still incomplete after this long is dropped (and counted)."""
    straggler_wait_s: float = Field(10.0, ge=0)
    """A step waits up to this long for an incomplete group that the step would push past max_lag
    (one slow reward task would otherwise make its whole group stale); 0: never wait."""
    keep_versions: int = Field(3, ge=1)
    """Published weight versions kept in the object store (older ones are deleted)."""
    publish_every: int = Field(1, ge=1)
    """Steps between weights publications (and at a clean stop); versions count steps, so
    samples can be up to publish_every - 1 versions old when generated: max_lag must allow it."""
    checkpoint_every: int = Field(10, ge=0)
    """Steps between checkpoints (0: none; offsets are then committed every step)."""
    keep_checkpoints: int = Field(2, ge=1)
    checkpoint_layout: Literal["full", "sharded"] = "full"
    """full: rank 0 gathers the whole model and optimizer state into one object; sharded: every rank
    writes its own shards of them (learner/sharded_checkpoint.py), so no rank ever holds the whole
    state. One learner process writes full either way; both resume on any number of ranks."""
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    max_importance_weight: float = Field(5.0, ge=1)
    std_normalise: bool = True
    aggregation: Literal["token", "sequence"] = "token"
    objective: Literal["behaviour", "decoupled", "on_policy"] = "behaviour"
    """behaviour: PPO-clip against the behaviour logprobs (truncated IS); decoupled: clip around the
    proximal (current) policy, weight by pi_prox / pi_behaviour; on_policy: no off-policy correction."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty against the frozen starting policy (0: off)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the policy's token entropy as a bonus in the objective (0: off; it is reported either way)."""
    pack_tokens: int = Field(4096, ge=0)
    """Sequences are packed (no padding) into packs of this many tokens; 0: pad instead."""
    activation_checkpointing: bool = False
    attn_implementation: Literal["sdpa", "flash_attention_2", "flex_attention"] = "sdpa"
    """The attention kernel the learner's model uses. flash_attention_2 (the flash-attn extra, a CUDA GPU)
    takes packed sequences through its varlen kernel: memory linear in the pack, but a group's prompt is
    laid down once per sample (learner/packing.py). flex_attention (PyTorch's FlexAttention) takes each
    pack's tree as a block-sparse mask: a group's prompt once, fully masked blocks skipped when compiled
    on a GPU (it trains on a CUDA GPU only: PyTorch has no FlexAttention backward on CPU). Checked at
    start. Not eager: it adds a pack's boolean mask to the scores instead of applying it (its packed
    log-probs came out wrong)."""
    context_parallel: int = Field(1, ge=1)
    """Ranks each packed sequence is split across (ring attention, learner/context_parallel.py): packs
    of pack_tokens tokens with 1/context_parallel of their activations per rank. Must divide the ranks."""
    micro_batch: int = Field(0, ge=0)
    """Sequences per forward/backward; gradients accumulate over the step's batch (0: all at once)."""
    updates_per_batch: int = Field(1, ge=1)
    """Optimizer updates on each step's batch (PPO's epochs, GRPO's mu), every one clipped against the
    same behaviour log-probabilities; the learning-rate schedule counts steps, not updates."""
    publish_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The floating dtype of the weights published for the rollout workers (and exported): auto is
    bfloat16 when the learner trains on a GPU (half the bytes stored and moved per version) and
    float32 on a CPU, which has no fast bfloat16 matmul for the reference engine."""
    step_process: bool = False
    """Run the optimizer steps in a child process (learner/step_process.py), so they share no GIL
    with the service's event loop: a CPU learner of one rank (refused with several ranks or a GPU)."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of the full model (None: full fine-tuning). One learner process
    (not with several ranks, context_parallel or a vision-language model)."""

    @model_validator(mode="after")
    def _lag_allows_publishing(self) -> LearnerConfig:
        if self.stale_decay == 0 and self.max_lag < self.publish_every - 1:
            raise ValueError(
                f"max_lag ({self.max_lag}) must be at least publish_every - 1 ({self.publish_every - 1}): samples of the "
                "newest published weights would be dropped as stale"
            )
        if self.context_parallel > 1 and self.pack_tokens == 0:
            raise ValueError("learner.context_parallel > 1 splits packs: it needs pack_tokens > 0")
        if self.lora is not None and self.context_parallel > 1:
            raise ValueError("learner.lora trains on one learner process: not with context_parallel > 1")
        if self.context_parallel > 1 and self.attn_implementation != "sdpa":
            raise ValueError(f"learner.context_parallel > 1 runs its own ring attention kernel in place of sdpa; "
                             f"attn_implementation {self.attn_implementation} cannot be split")  # fmt: skip
        return self


class EvalConfig(_Section):
    """Held-out evaluation during a run (``conveyor serve evaluator``, in its own process): the
    records of ``data.files`` outside ``data.split``, through the same engines and verifiers."""

    every: int = Field(0, ge=0)
    """Evaluate every this many policy versions (and the starting policy); 0: no evaluator."""
    k: int = Field(1, ge=1)
    """pass@k's k."""
    samples: int | None = Field(None, ge=1)
    """Samples per task (None: k; one sample is greedy)."""
    max_tasks: int = Field(200, ge=1)
    """Held-out tasks evaluated (the first this many)."""
    engine: Literal["reference", "vllm"] | None = None
    """None: the rollout workers' engine."""

    @model_validator(mode="after")
    def _samples_cover_k(self) -> EvalConfig:
        if self.samples is not None and self.samples < self.k:
            raise ValueError("samples must be >= k")
        return self


class BridgeConfig(_Section):
    """The reward bridge: rollouts topic -> reward tasks -> scored topic."""

    max_batch: int = Field(256, ge=1)
    """Rollouts taken per poll."""
    max_inflight: int = Field(512, ge=1)
    """Rollouts being scored at once; each verdict is published as it completes."""
    drain_timeout_s: float = Field(60.0, gt=0)
    """How long a stop may take to score what was already generated; after it the bridge exits 1
    and the unscored rollouts are redelivered (their offsets were not committed)."""


class SinkConfig(_Section):
    """The storage sink: scored topic -> the run's rollouts table (Delta Lake) in the object store."""

    flush_rows: int = Field(512, ge=1)
    """Flush after this many rollouts..."""
    flush_s: float = Field(5.0, ge=0.05)
    """...or when the oldest buffered one is this old."""
    max_inflight: int = Field(2, ge=1)
    """Flushes written at once (offsets still commit in order)."""
    backoff_max_s: float = Field(10.0, gt=0)
    """Longest wait between retries of a failed write."""
    give_up_after_s: float = Field(3600.0, gt=0)
    """A write still failing after this long stops the sink (non-zero exit) instead of retrying forever."""
    dedupe_window: int = Field(200_000, ge=0)
    """Rollout ids this sink stored recently (per process): a scored rollout published twice upstream
    (a reward bridge that died between publishing and committing) is stored once. Offsets make the
    sink itself exactly once; this covers the records before it. 0: off."""


# --------------------------------------------------------------------------
# cross-cutting


class ClaimCheckConfig(_Section):
    threshold_bytes: int = Field(512 << 10, ge=1024)
    """Encoded messages larger than this go to the object store; the topic carries a reference."""
    key_prefix: str = "claims"


class RunConfig(BaseSettings):
    """A whole run: which backends, and how each service is tuned."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", env_nested_delimiter="__", extra="forbid", frozen=True)

    run_id: str = "default"
    """Namespace of the run's topics and objects."""
    transport: TransportConfig = Field(default_factory=MemoryTransportConfig)
    object_store: ObjectStoreConfig = Field(default_factory=LocalStoreConfig)
    celery: CeleryBrokerConfig = Field(default_factory=LocalExecutorConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    producer: ProducerConfig = Field(default_factory=ProducerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    bridge: BridgeConfig = Field(default_factory=BridgeConfig)
    sink: SinkConfig = Field(default_factory=SinkConfig)
    claim_check: ClaimCheckConfig = Field(default_factory=ClaimCheckConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str) -> str:
        return validate_run_id(v)

    @model_validator(mode="after")
    def _time_limits_nest(self) -> RunConfig:
        check_run_config(self)  # conveyor/config_checks.py: Celery redelivery, Kafka's max poll interval
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first: an operator's override beats the file.
        return (env_settings, init_settings)


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "tagged-union")))
        lines.append(f"  {loc or '<root>'}: {err['msg']}")
    return "\n".join(lines)


def parse_run_config(data: dict[str, Any], source: str = "<dict>") -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return RunConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def _merged(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(base[k], v) if isinstance(v, Mapping) and isinstance(base.get(k), dict) else v
    return out


def with_overrides(base: RunConfig | Mapping[str, Any], overrides: Mapping[str, Any], source: str) -> RunConfig:
    """``base`` (a run config, or a mapping as in a file) with ``overrides`` merged into it, section
    by section (``{"learner": {"max_lag": 0}}`` changes that one field), and checked like a file:
    a bad value raises ConfigError naming the field."""
    data = base.model_dump(mode="python") if isinstance(base, RunConfig) else dict(base)
    return parse_run_config(_merged(data, overrides), source)


def load_run_config(path: str | Path) -> RunConfig:
    """Load and validate a run config; every failure is a :class:`ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {exc}") from None
    return parse_run_config(data, str(path))
