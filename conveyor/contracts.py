"""Message contracts: everything that crosses a process boundary.

Every message is a frozen msgspec struct, encoded as msgpack with a type tag
(``"t"`` on the wire) so that a consumer can tell a ``Task`` from a
``ClaimRef`` or from garbage. Nothing is ever pickled.

Numeric sequences (token ids, logprobs, loss masks) travel as packed
little-endian arrays (``Int32Array`` -> msgpack ``bin`` of int32,
``Float32Array`` -> ``bin`` of float32, ``UInt8Array`` -> ``bin`` of uint8):
a 4k-token trajectory is 32 KB on the wire instead of ~60 KB of msgpack ints
and doubles, and decoding is a memcpy.

Ids are deterministic where redelivery is possible: ``rollout_id`` is derived
from ``(task_id, sample_index, attempt)``, so a redelivered rollout *is* the
same rollout and every consumer can be idempotent on it.

Usage::

    from conveyor.contracts import Task, encode, decode
    raw = encode(Task(task_id="t1", run_id="r", prompt="1+1="))
    task = decode(raw, Task)   # raises DecodeError on garbage or wrong type
"""

from __future__ import annotations

import array
import hashlib
import sys
import time
from typing import Any, Literal, TypeVar

import msgspec

SCHEMA_VERSION = 1
_BIG_ENDIAN = sys.byteorder == "big"


class DecodeError(ValueError):
    """Bytes that are not a valid message of the expected type."""


# --------------------------------------------------------------------------
# packed numeric arrays


class _PackedArray(array.array):
    """An ``array.array`` with a fixed typecode, packed little-endian on the wire."""

    TYPECODE = "b"
    ITEMSIZE = 1

    def __new__(cls, values: Any = ()):  # noqa: D102 - array.array signature
        if isinstance(values, (bytes, bytearray, memoryview)):
            return cls.from_wire(values)
        return array.array.__new__(cls, cls.TYPECODE, values)

    @classmethod
    def from_wire(cls, data: bytes | bytearray | memoryview) -> "_PackedArray":
        arr = array.array.__new__(cls, cls.TYPECODE)
        arr.frombytes(data)
        if _BIG_ENDIAN:
            arr.byteswap()
        return arr

    def to_wire(self) -> bytes:
        if _BIG_ENDIAN:
            swapped = array.array(self.TYPECODE, self)
            swapped.byteswap()
            return swapped.tobytes()
        return self.tobytes()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, array.array):
            return self.tolist() == other.tolist()
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class Int32Array(_PackedArray):
    """Token ids (int32)."""

    TYPECODE = "i"
    ITEMSIZE = 4


class Float32Array(_PackedArray):
    """Per-token logprobs (float32)."""

    TYPECODE = "f"
    ITEMSIZE = 4


class UInt8Array(_PackedArray):
    """Loss masks (0 = not trained on, 1 = trained on)."""

    TYPECODE = "B"


_PACKED = (Int32Array, Float32Array, UInt8Array)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, _PackedArray):
        return obj.to_wire()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ in _PACKED:
        if type(obj) is not bytes:
            raise ValueError(f"expected packed bytes for {typ.__name__}")
        if len(obj) % typ.ITEMSIZE:
            raise ValueError(f"{typ.__name__} payload of {len(obj)} bytes is not a multiple of {typ.ITEMSIZE}")
        return typ.from_wire(obj)
    raise NotImplementedError(f"cannot decode {typ}")


# --------------------------------------------------------------------------
# base


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="t"):
    """Base of every wire message: schema version and creation time."""

    schema_version: int = SCHEMA_VERSION
    created_at: float = msgspec.field(default_factory=time.time)  # unix seconds


# --------------------------------------------------------------------------
# tasks


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None  # tool name for role == "tool"


class VerifierSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the reward service runs to score a completion.

    ``kind`` selects a verifier (``python_tests``, ``terminal``, ``math``,
    ``tool_call``, ...); ``data`` is that verifier's own payload (tests,
    ground truth, expected state), opaque to the transport.
    """

    kind: str
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
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

    def __post_init__(self) -> None:
        if self.prompt is None and not self.messages:
            raise ValueError("Task needs a prompt or chat messages")
        if self.group_size < 1:
            raise ValueError("Task.group_size must be >= 1")


# --------------------------------------------------------------------------
# rollouts


def rollout_id(task_id: str, sample_index: int, attempt: int = 0) -> str:
    """Deterministic id of the ``sample_index``-th sample of a task attempt.

    A redelivered task regenerates rollouts under the same ids, so the reward
    bridge, learner and storage sink deduplicate them.
    """
    digest = hashlib.blake2b(
        f"{task_id}\x1f{sample_index}\x1f{attempt}".encode(), digest_size=12
    ).hexdigest()
    return f"ro-{digest}"


class VersionSegment(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Completion tokens ``[start, end)`` were produced by ``policy_version``.

    On the wire: ``[start, end, policy_version]``.
    """

    start: int
    end: int
    policy_version: int


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    call_id: str | None = None


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of a (multi-turn) episode, as text, for humans and SFT export."""

    role: Literal["system", "user", "assistant", "tool"]
    text: str
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class Timings(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
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
    prompt_token_ids: Int32Array
    completion_token_ids: Int32Array
    behaviour_logprobs: Float32Array  # log p_behaviour(token), the sampled distribution
    loss_mask: UInt8Array
    version_segments: list[VersionSegment]
    turns: list[Turn] = msgspec.field(default_factory=list)
    finish_reason: Literal["stop", "length", "abort", "tool_limit", "error"] = "stop"
    timings: Timings = msgspec.field(default_factory=Timings)
    task: Task | None = None  # the task it answers (verifier spec travels with it)

    def __post_init__(self) -> None:
        n = len(self.completion_token_ids)
        if len(self.behaviour_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(
                f"Rollout arrays disagree: {n} tokens, {len(self.behaviour_logprobs)} logprobs, "
                f"{len(self.loss_mask)} mask entries"
            )

    @property
    def min_policy_version(self) -> int:
        return min((s.policy_version for s in self.version_segments), default=-1)


class Feedback(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
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

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id


# --------------------------------------------------------------------------
# learner -> workers


class WeightsAnnouncement(Message, frozen=True, kw_only=True, tag="weights"):
    """A new policy version is in the object store. Key: ``run_id`` (compacted)."""

    run_id: str
    version: int
    uri: str  # object-store URI of the safetensors directory / manifest
    sha256: str  # checksum of the manifest at ``uri``
    step: int = 0


class LearnerProgress(Message, frozen=True, kw_only=True, tag="progress"):
    """What the learner has consumed; drives admission control. Key: ``run_id``."""

    run_id: str
    samples_consumed: int
    policy_version: int
    step: int = 0


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
    raw: bytes
    error: str
    service: str


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
    for cls in (Task, Rollout, ScoredRollout, WeightsAnnouncement, LearnerProgress, DeadLetter, ClaimRef)
}

_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def _decoder(typ: Any) -> msgspec.msgpack.Decoder:
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ, dec_hook=_dec_hook)
    return dec


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(raw: bytes, typ: type[M]) -> M:
    """Decode ``raw`` as ``typ``; any failure is a :class:`DecodeError`."""
    try:
        return _decoder(typ).decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise DecodeError(f"not a valid {typ.__name__}: {exc}") from exc


def decode_or_claim(raw: bytes, typ: type[M]) -> M | ClaimRef:
    """Decode a topic value that is either ``typ`` or a claim check for one."""
    try:
        return _decoder(typ | ClaimRef).decode(raw)  # type: ignore[operator]
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise DecodeError(f"not a valid {typ.__name__}: {exc}") from exc


def decode_any(raw: bytes) -> Message:
    """Decode any known message type (for ``conveyor topics tail``)."""
    union = Task | Rollout | ScoredRollout | WeightsAnnouncement | LearnerProgress | DeadLetter | ClaimRef
    return decode(raw, union)  # type: ignore[arg-type]


def to_builtins(msg: Message) -> Any:
    """A JSON-friendly view of a message (packed arrays become lists)."""

    def hook(obj: Any) -> Any:
        if isinstance(obj, _PackedArray):
            return obj.tolist()
        if isinstance(obj, (bytes, bytearray)):
            return obj.hex() if len(obj) <= 64 else f"<{len(obj)} bytes>"
        raise NotImplementedError

    return msgspec.to_builtins(msg, enc_hook=hook, builtin_types=())
