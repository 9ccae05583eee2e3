"""Message contracts: everything that crosses a process boundary.

Every message is a frozen msgspec struct, encoded as msgpack with a type tag
(``"t"`` on the wire) so that a consumer can tell a ``Task`` from a
``ClaimRef`` or from garbage. Nothing is ever pickled.

Numeric sequences (token ids, logprobs, loss masks) travel as packed
little-endian arrays (msgpack ``bin`` of int32, float32 or uint8) and are
typed ``memoryview`` objects in memory: a 4k-token trajectory is 36 KB on the
wire instead of ~60 KB of msgpack ints and doubles, and decoding them is
zero-copy.

Ids are deterministic where redelivery is possible: ``rollout_id`` is derived
from ``(task_id, sample_index, attempt)``, so a redelivered rollout *is* the
same rollout and every consumer can be idempotent on it.

Usage::

    from conveyor.contracts import Task, encode, decode
    raw = encode(Task(task_id="t1", run_id="r", prompt="1+1="))
    task = decode(raw, Task)   # raises DecodeError on garbage or wrong type
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any, Literal, TypeVar

import msgspec

from conveyor.chat import IMAGE_PLACEHOLDER as IMAGE_PLACEHOLDER  # the chat parts (conveyor/chat.py), re-exported
from conveyor.chat import ChatMessage as ChatMessage
from conveyor.chat import ContentPart as ContentPart
from conveyor.chat import ImagePart as ImagePart
from conveyor.chat import TextPart as TextPart
from conveyor.chat import task_images as task_images
from conveyor.limits import MAX_ABS_REWARD, MAX_GROUP_SIZE, check_depth
from conveyor.limits import MAX_DATA_DEPTH as MAX_DATA_DEPTH
from conveyor.limits import nesting_depth as nesting_depth
from conveyor.packed import _BIG_ENDIAN, _packed
from conveyor.packed import float32_array as float32_array
from conveyor.packed import int32_array as int32_array
from conveyor.packed import uint8_array as uint8_array

SCHEMA_VERSION = 2
"""The newest schema this code reads. Version 2 added image parts to chat messages; a message
carrying none is still written as version 1, so readers of version 1 keep reading text-only
traffic and dead-letter (rather than misread) what has images."""
IMAGE_SCHEMA_VERSION = 2
WRITTEN_SCHEMA_VERSION = 1


class DecodeError(ValueError):
    """Bytes that are not a valid message of the expected type."""


# --------------------------------------------------------------------------
# base


class Message(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag_field="t"):
    """Base of every wire message: schema version and creation time.

    Contract structs are ``gc=False``: plain data that never forms a reference
    cycle, so the garbage collector need not track them (a sink or replay
    holding thousands decodes them 3x slower when it does; docs/BENCHMARKS.md).
    Do not put a message inside its own fields' containers."""

    schema_version: int = WRITTEN_SCHEMA_VERSION  # raised to IMAGE_SCHEMA_VERSION by a message with images
    created_at: float = msgspec.field(default_factory=time.time)  # unix seconds


# --------------------------------------------------------------------------
# tasks


class VerifierSpec(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What the reward service runs to score a completion.

    ``kind`` selects a verifier (``python_tests``, ``terminal``, ``math``,
    ``tool_call``, ...); ``data`` is that verifier's own payload (tests,
    ground truth, expected state), opaque to the transport.
    """

    kind: str
    data: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_depth(self.data, "verifier.data")


class SamplingParams(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 512
    stop: list[str] = msgspec.field(default_factory=list)
    seed: int | None = None


class Task(Message, frozen=True, kw_only=True, tag="task"):
    """One problem to sample a group of completions for. Key: ``task_id``."""

    task_id: str
    run_id: str
    prompt: str | None = None  # plain-text prompt, or
    messages: list[ChatMessage] | None = None  # chat messages rendered by the worker
    verifier: VerifierSpec = msgspec.field(default_factory=lambda: VerifierSpec(kind="none"))
    group_size: int = 1
    sampling: SamplingParams | None = None  # None: the worker's defaults
    split: Literal["train", "heldout"] = "train"
    priority: int = 0
    attempt: int = 0  # incremented when the producer re-queues a task
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    max_turns: int = 1
    """Attempts per sample: above 1, a failed attempt's execution feedback is fed back to the
    model, which tries again (multi-turn self-correction, rollout_workers/multiturn.py)."""
    tools: list[dict[str, Any]] | None = None
    """Functions the model may call, in OpenAI's format (``{"type": "function", "function": {name,
    description, parameters}}``, or the function object alone; parameters a JSON Schema): given to
    the chat template, and the schemas the ``tool_call`` verifier validates calls against."""

    def __post_init__(self) -> None:
        if self.prompt is None and not self.messages:
            raise ValueError("Task needs a prompt or chat messages")
        if self.tools is not None and not all(isinstance(t, dict) for t in self.tools):
            raise ValueError("Task.tools must be a list of objects")
        if not 1 <= self.group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"Task.group_size must be in [1, {MAX_GROUP_SIZE}]")
        if self.max_turns < 1:
            raise ValueError("Task.max_turns must be >= 1")
        if self.schema_version < IMAGE_SCHEMA_VERSION and task_images(self.messages):
            _force_setattr(self, "schema_version", IMAGE_SCHEMA_VERSION)

    @property
    def images(self) -> list[ImagePart]:
        return task_images(self.messages)


# --------------------------------------------------------------------------
# rollouts


def rollout_id(task_id: str, sample_index: int, attempt: int = 0) -> str:
    """Deterministic id of the ``sample_index``-th sample of a task attempt.

    A redelivered task regenerates rollouts under the same ids, so the reward
    bridge, learner and storage sink deduplicate them.
    """
    digest = hashlib.blake2b(f"{task_id}\x1f{sample_index}\x1f{attempt}".encode(), digest_size=12).hexdigest()
    return f"ro-{digest}"


class VersionSegment(msgspec.Struct, frozen=True, gc=False, kw_only=True, array_like=True):
    """Completion tokens ``[start, end)`` were produced by ``policy_version``.

    On the wire: ``[start, end, policy_version]``.
    """

    start: int
    end: int
    policy_version: int


class ToolCall(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    call_id: str | None = None

    def __post_init__(self) -> None:
        check_depth(self.arguments, "tool call arguments")


class Turn(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One turn of a (multi-turn) episode, as text, for humans and SFT export."""

    role: Literal["system", "user", "assistant", "tool"]
    text: str
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


def tool_episode_script(turns: list[Turn]) -> str | None:
    """The net script of a tool episode: the shell commands of the calls that were kept
    (``ToolCall.arguments["kept"]``, ``["replay"]``), in order; None when no turn made a call.
    Replayed from the task's base it reproduces the episode's final workspace."""
    calls = [c for t in turns if t.role == "assistant" for c in t.tool_calls]
    if not calls:
        return None
    return "\n".join(str(c.arguments.get("replay", "")) for c in calls if c.arguments.get("kept"))


class Timings(msgspec.Struct, frozen=True, gc=False, kw_only=True, omit_defaults=True):
    """Unix-second timestamps; zero when not measured."""

    task_received_at: float = 0.0
    generation_started_at: float = 0.0
    generation_finished_at: float = 0.0


class Rollout(Message, frozen=True, kw_only=True, tag="rollout"):
    """One sampled completion (possibly multi-turn). Key: ``task_id``.

    ``completion_token_ids``, ``behaviour_logprobs`` and ``loss_mask`` are
    aligned: one entry per completion token. Tool observations spliced into
    the completion carry ``loss_mask == 0`` (not trained on) and logprob 0.
    """

    rollout_id: str
    task_id: str
    run_id: str
    sample_index: int
    attempt: int = 0
    group_size: int = 1
    prompt_token_ids: memoryview  # bin: int32 LE
    completion_token_ids: memoryview  # bin: int32 LE
    behaviour_logprobs: memoryview  # bin: float32 LE, log p_behaviour(token) of the sampled distribution
    loss_mask: memoryview  # bin: uint8, 1 = trained on
    version_segments: list[VersionSegment]
    turns: list[Turn] = msgspec.field(default_factory=list)
    finish_reason: Literal["stop", "length", "abort", "tool_limit", "error"] = "stop"
    timings: Timings = msgspec.field(default_factory=Timings)
    task: Task | None = None  # the task it answers (verifier spec travels with it)
    error: str | None = None
    """Why the worker refused the task (``finish_reason == "error"``): no tokens, scored ``infra``,
    so the learner counts the samples consumed without training on them."""

    def __post_init__(self) -> None:
        if self.task is not None and self.task.schema_version > self.schema_version:
            _force_setattr(self, "schema_version", self.task.schema_version)
        for name, fmt, size in _ROLLOUT_ARRAYS:
            v = getattr(self, name)
            if type(v) is memoryview:  # the decode path: a 'B' view of the wire bytes
                if v.format == fmt:
                    continue
                if v.format == "B" and not _BIG_ENDIAN and len(v) % size == 0:
                    _force_setattr(self, name, v.cast(fmt))  # type: ignore[call-overload]
                    continue
            _force_setattr(self, name, _packed(v, fmt, name))
        n = len(self.completion_token_ids)
        if len(self.behaviour_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(
                f"Rollout arrays disagree: {n} tokens, {len(self.behaviour_logprobs)} logprobs, "
                f"{len(self.loss_mask)} mask entries"
            )
        if n and not len(self.prompt_token_ids):
            raise ValueError(
                "Rollout has completion tokens but no prompt tokens: the first completion token is "
                "predicted from the prompt's last position (engines start every prompt with at least one token)"
            )

    @property
    def min_policy_version(self) -> int:
        return min((s.policy_version for s in self.version_segments), default=-1)

    @property
    def max_policy_version(self) -> int:
        return max((s.policy_version for s in self.version_segments), default=-1)


_ROLLOUT_ARRAYS = (
    ("prompt_token_ids", "i", 4),
    ("completion_token_ids", "i", 4),
    ("behaviour_logprobs", "f", 4),
    ("loss_mask", "B", 1),
)
_force_setattr = msgspec.structs.force_setattr


class Feedback(msgspec.Struct, frozen=True, gc=False, kw_only=True, omit_defaults=True):
    """A readable account of what went wrong, fed back to the model."""

    exception_type: str | None = None
    message: str | None = None
    file: str | None = None
    line: int | None = None
    failing_test: str | None = None
    text: str = ""


class ScoredRollout(Message, frozen=True, kw_only=True, tag="scored"):
    """A rollout with its reward. Key: ``task_id``."""

    rollout: Rollout
    reward: float
    verdict: Literal["pass", "fail", "error", "timeout", "memory", "output_limit", "infra"]
    feedback: Feedback | None = None
    details: dict[str, float] = msgspec.field(default_factory=dict)
    scored_at: float = msgspec.field(default_factory=time.time)
    completion_text: str | None = None  # the completion as the verifier read it (for the lake and humans)

    def __post_init__(self) -> None:
        if self.rollout.schema_version > self.schema_version:
            _force_setattr(self, "schema_version", self.rollout.schema_version)
        if not math.isfinite(self.reward) or abs(self.reward) > MAX_ABS_REWARD:
            raise ValueError(f"reward {self.reward!r} is not a finite number within ±{MAX_ABS_REWARD:g}")

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id


# --------------------------------------------------------------------------
# learner -> workers


class WeightsAnnouncement(Message, frozen=True, kw_only=True, tag="weights"):
    """A new policy version is in the object store. Key: ``run_id`` (compacted)."""

    run_id: str
    version: int
    key: str  # object-store key of the weights (safetensors)
    uri: str  # the same, as a URI for humans (s3://bucket/key, file://...)
    sha256: str  # checksum of the object at ``key``
    step: int = 0


class LearnerProgress(Message, frozen=True, kw_only=True, tag="progress"):
    """What the learner has consumed; drives admission control. Key: ``run_id``."""

    run_id: str
    samples_consumed: int
    policy_version: int
    step: int = 0
    reward_mean: float | None = None  # of the last step's batch
    max_staleness: int | None = None  # policy versions between the last step's oldest sample and its weights


class Admission(Message, frozen=True, kw_only=True, tag="admission"):
    """One entry of the run's admission ledger (the single-partition ``admissions`` topic),
    which every rollout worker and producer reads in the same order (``conveyor/admission.py``).

    ``kind`` "claim": a rollout worker is about to generate these task attempts; the ledger's
    order gives each attempt its ticket (the samples claimed up to and including it, counting
    each attempt once, whoever claims it again). ``kind`` "offer": a producer published them
    to the tasks topic. ``keys[i]`` is ``"<task_id>/<attempt>"``, ``samples[i]`` its group size.
    Key: ``run_id``."""

    run_id: str
    kind: Literal["claim", "offer"]
    member: str  # the claiming worker's or offering producer's instance id
    keys: list[str]
    samples: list[int]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.samples):
            raise ValueError(f"admission: {len(self.keys)} keys but {len(self.samples)} sample counts")
        if any(n < 1 for n in self.samples):
            raise ValueError("admission: every sample count must be >= 1")


def attempt_key(task_id: str, attempt: int) -> str:
    """The admission ledger's key of one attempt of a task."""
    return f"{task_id}/{attempt}"


class Heartbeat(Message, frozen=True, kw_only=True, tag="heartbeat"):
    """A service instance is alive (``conveyor status`` counts them). Every service publishes one
    every ``interval_s`` seconds. Key: ``instance``."""

    run_id: str
    role: str
    instance: str  # host:pid
    interval_s: float


# --------------------------------------------------------------------------
# operators


class DeadLetter(Message, frozen=True, kw_only=True, tag="dead_letter"):
    """A message a consumer could not process. Key: the original key.

    ``dead_letter_id`` is derived from the source position, so redelivery of
    the same bad record produces the same id.
    """

    dead_letter_id: str
    source_topic: str
    source_partition: int
    source_offset: int
    key: bytes | None
    raw: bytes  # the record's value, cut at DEAD_LETTER_RAW_LIMIT (the full value stays at the source offset)
    error: str
    service: str
    raw_size: int = 0  # the full value's size in bytes
    raw_truncated: bool = False


def dead_letter_id(topic: str, partition: int, offset: int) -> str:
    return "dl-" + hashlib.blake2b(f"{topic}\x1f{partition}\x1f{offset}".encode(), digest_size=12).hexdigest()


class ClaimRef(Message, frozen=True, kw_only=True, tag="claim"):
    """Stands in for a message too large for a topic (claim check).

    The encoded message lives at ``uri`` in the object store; ``sha256`` and
    ``size`` verify it when it is fetched back.
    """

    key: str  # object-store key of the encoded message
    uri: str  # where that is, for humans (s3://bucket/key or file://...)
    sha256: str
    size: int
    message_type: str  # the tag of the message stored at ``key``


# --------------------------------------------------------------------------
# codec

M = TypeVar("M", bound=Message)

MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (Task, Rollout, ScoredRollout, WeightsAnnouncement, LearnerProgress, Admission, DeadLetter, ClaimRef)
}

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def _no_ext(code: int, data: memoryview) -> Any:
    # No contract uses msgpack extension types; one inside a free-form payload would decode to an
    # Ext object that every later step (the lake's Arrow writer, Celery's serializer) chokes on.
    raise ValueError(f"msgpack extension type {code} is not allowed in a message")


def _decoder(typ: Any) -> msgspec.msgpack.Decoder:
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ, ext_hook=_no_ext)
    return dec


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def _checked(msg: Any, typ: Any) -> Any:
    version = getattr(msg, "schema_version", SCHEMA_VERSION)
    if version > SCHEMA_VERSION:
        # Fields a newer schema added would be silently dropped: refuse instead of guessing.
        raise DecodeError(f"{type(msg).__name__} has schema version {version}; this code reads up to {SCHEMA_VERSION}")
    return msg


def decode(raw: bytes, typ: type[M]) -> M:
    """Decode ``raw`` as ``typ``; any failure (newer schema versions included) is a :class:`DecodeError`."""
    try:
        msg = _decoder(typ).decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise DecodeError(f"not a valid {getattr(typ, '__name__', 'message')}: {exc}") from exc
    return _checked(msg, typ)


_claim_unions: dict[type, Any] = {}


def decode_or_claim(raw: bytes, typ: type[M]) -> M | ClaimRef:
    """Decode a topic value that is either ``typ`` or a claim check for one."""
    union = _claim_unions.get(typ)
    if union is None:
        union = _claim_unions[typ] = typ | ClaimRef  # type: ignore[operator]
    try:
        msg = _decoder(union).decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise DecodeError(f"not a valid {typ.__name__}: {exc}") from exc
    return _checked(msg, typ)


def decode_any(raw: bytes) -> Message:
    """Decode any known message type (for ``conveyor topics tail``)."""
    union = Task | Rollout | ScoredRollout | WeightsAnnouncement | LearnerProgress | DeadLetter | ClaimRef
    return decode(raw, union)  # type: ignore[arg-type]


def to_builtins(msg: Message) -> Any:
    """A JSON-friendly view of a message (packed arrays become lists)."""

    def convert(obj: Any) -> Any:
        if isinstance(obj, memoryview):
            return obj.tolist()
        if isinstance(obj, (bytes, bytearray)):
            return obj.hex() if len(obj) <= 64 else f"<{len(obj)} bytes>"
        if isinstance(obj, dict):
            return {k: convert(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [convert(v) for v in obj]
        return obj

    return convert(msgspec.to_builtins(msg, builtin_types=(memoryview, bytes, bytearray)))
