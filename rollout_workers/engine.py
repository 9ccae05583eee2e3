"""The engine interface every rollout backend implements.

One async interface (``AsyncEngine``):

- ``await generate(request)``: ``request.n`` completions of one prompt, each
  with its token ids, the per-token log-probabilities *of the distribution it
  was sampled from* (after temperature), its finish reason, and the policy
  versions that produced which tokens (``segments``): a request in flight
  across a weight swap records where the new version took over;
- ``await abort(request_id)``: the request ends now; its waiter gets
  completions with finish reason ``"abort"``;
- ``await swap(weights, version)``: load a new policy version (safetensors
  bytes, already checksum-verified by the caller) without restarting the
  engine; weights that do not fit the model are refused before anything is
  loaded (:class:`WeightsRejected`) and the engine keeps serving the current
  version.

Backends: :class:`rollout_workers.vllm_engine.VLLMEngine` (vLLM ``AsyncLLM``:
continuous batching, prefix caching, speculative decoding) and
:class:`BatchingEngine`, which gives a synchronous batch engine (the
reference engine in plain PyTorch, in process or in a child process) the
same interface by batching every request that arrives while the previous
batch runs.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Protocol

from conveyor import adapters


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    policy_version: int
    """The version that produced the first token (the oldest one involved)."""
    segments: tuple[tuple[int, int, int], ...] = ()
    """``(start, end, version)`` token ranges; empty means one version produced every token."""

    def version_segments(self) -> tuple[tuple[int, int, int], ...]:
        return self.segments or ((0, len(self.token_ids), self.policy_version),)


_ids = itertools.count()


@dataclass(frozen=True)
class SamplingRequest:
    prompt_token_ids: list[int]
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: frozenset[int] = frozenset()
    greedy: bool = False
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    images: tuple = ()
    """The prompt's pictures (PIL images, in prompt order) for a vision-language model."""

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one reference-engine batch."""
        return (self.n, self.max_tokens, self.temperature, self.top_p, self.stop_token_ids, self.greedy)


class WeightsRejected(ValueError):
    """A weights object that does not fit the served model; nothing was loaded."""


class AsyncEngine(Protocol):
    version: int

    async def start(self) -> None: ...
    async def generate(self, request: SamplingRequest) -> list[Completion]: ...
    async def abort(self, request_id: str) -> None: ...
    async def swap(self, weights: bytes, version: int) -> None: ...
    async def close(self) -> None: ...
    def encode(self, text: str) -> list[int]: ...
    def encode_prompt(self, prompt: str | None, messages=None, tools=None) -> list[int]: ...
    def encode_observation(self, text: str, role: str, *, chat: bool, after: list[int]) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def stop_rules(stops, encode) -> tuple[frozenset[int], tuple[str, ...]]:
    """Stop strings split by how they are applied: one-token strings as stop token ids (the engine
    stops on them), longer ones as text (:func:`cut_at_stop_strings` after sampling)."""
    encoded = [(s, encode(s)) for s in stops]
    return frozenset(ids[0] for _, ids in encoded if len(ids) == 1), tuple(s for s, ids in encoded if len(ids) > 1)


def cut_at_stop_strings(c: Completion, stops: tuple[str, ...], decode) -> Completion:
    """``c`` ended after the first token that completes one of ``stops`` (the stop string kept, as
    vLLM's ``include_stop_str_in_output``); unchanged when no stop string occurs.

    Stop strings of one token are stop tokens already; a longer one can only be found in the text.
    Whether a prefix of the tokens contains a stop string is monotone in the prefix's length, so
    the shortest such prefix takes a binary search of decodes, not one per token."""
    if not stops or not c.token_ids or not any(s in decode(c.token_ids) for s in stops):
        return c
    lo, hi = 1, len(c.token_ids)  # the shortest prefix containing a stop string lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(c.token_ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    segments = tuple((a, min(b, lo), v) for a, b, v in c.segments if a < lo)
    return Completion(c.token_ids[:lo], c.logprobs[:lo], "stop", c.policy_version, segments)


def check_weights(data: bytes, expected: dict[str, tuple[int, ...]], *, tied: set[str] = frozenset()) -> None:
    """Raise :class:`WeightsRejected` unless ``data`` (safetensors) holds exactly the tensors of
    ``expected`` (name -> shape), ``tied`` names optional. Reads only the header."""
    import json
    import struct

    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise WeightsRejected(f"not a safetensors object: {exc}") from None
    got = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    missing = sorted(set(expected) - set(got) - set(tied))
    unexpected = sorted(set(got) - set(expected) - set(tied))
    wrong = sorted(k for k in set(got) & set(expected) if got[k] != tuple(expected[k]))
    if missing or unexpected or wrong:
        raise WeightsRejected(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )


def check_finite(data: bytes) -> None:
    """Raise :class:`WeightsRejected` if a floating-point tensor of ``data`` (safetensors) holds a
    NaN or an infinity: a policy like that samples garbage or fails every request, and the bucket
    it comes from is writable by more than the learner. One pass over the weights."""
    import torch
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as exc:  # noqa: BLE001 - whatever the parser says, the object is not weights
        raise WeightsRejected(f"not a safetensors object: {exc}") from None
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise WeightsRejected(f"weights hold NaN or infinite values: {bad[:5]}")


class BatchingEngine:
    """The async interface over a synchronous batch engine (``generate(prompts, n, ...)``,
    ``load_state_dict``): requests that arrive while a batch runs form the next batch,
    grouped by sampling parameters. Swaps happen between batches."""

    supports_top_p = False  # the reference engine samples the whole distribution

    def __init__(self, engine, *, max_batch_rows: int = 512) -> None:
        self.inner = engine
        self.tokenizer = engine.tokenizer
        self.max_batch_rows = max_batch_rows
        self._pending: list[tuple[SamplingRequest, asyncio.Future]] = []
        self._aborted: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._runner: asyncio.Task | None = None
        self._base: dict | None = None  # the model directory's weights, once a LoRA version arrives
        if hasattr(engine, "model"):
            self._shapes = {k: tuple(v.shape) for k, v in engine.model.state_dict().items()}
        else:  # an engine in another process reports its model's shapes
            self._shapes = getattr(engine, "weight_shapes", None)

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def reads_images(self) -> bool:
        return getattr(self.inner, "reads_images", False)

    @property
    def max_context(self) -> int | None:
        return getattr(self.inner, "max_context", None)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def encode_prompt(self, prompt: str | None, messages=None, tools=None) -> list[int]:
        return self.inner.encode_prompt(prompt, messages, tools)

    def encode_observation(self, text: str, role: str, *, chat: bool, after: list[int]) -> list[int]:
        return self.inner.encode_observation(text, role, chat=chat, after=after)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)

    async def start(self) -> None:
        if self._runner is None:
            self._wake, self._lock = asyncio.Event(), asyncio.Lock()
            self._runner = asyncio.create_task(self._run(), name="batching-engine")

    async def generate(self, request: SamplingRequest) -> list[Completion]:
        if request.top_p != 1.0:
            raise ValueError("the reference engine samples the whole distribution: top_p must be 1.0")
        await self.start()
        if self._runner.done():  # the engine died: fail loudly, do not queue
            self._runner.result()
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self._wake.set()
        return await future

    async def abort(self, request_id: str) -> None:
        for i, (req, fut) in enumerate(self._pending):
            if req.request_id == request_id:
                del self._pending[i]
                if not fut.done():
                    fut.set_result(_aborted(req, self.version))
                return
        self._aborted.add(request_id)  # running: its result is discarded when the batch ends

    async def swap(self, weights: bytes, version: int) -> None:
        await self.start()
        if adapters.adapter_config(weights) is not None:  # a LoRA version: merged into the base model here
            weights = await asyncio.to_thread(self._merged, weights)
        if self._shapes is not None:
            check_weights(weights, self._shapes, tied={"lm_head.weight"})
        async with self._lock:  # between batches; the engine decodes the blob (in its own process, if it has one)
            await asyncio.to_thread(self.inner.load_weights, weights, version)

    def _merged(self, adapter: bytes) -> bytes:
        """The base model's weights with ``adapter`` merged in, as one safetensors blob."""
        from safetensors.torch import save

        if self._base is None:
            self._base = adapters.base_weights(self.inner.model_dir)
        try:
            return save({k: v.contiguous() for k, v in adapters.merged(self._base, adapter).items()})
        except ValueError as exc:
            raise WeightsRejected(str(exc)) from None

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
            self._runner = None
        for req, fut in self._pending:
            if not fut.done():
                fut.set_result(_aborted(req, self.version))
        self._pending.clear()
        if hasattr(self.inner, "close"):
            self.inner.close()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # requests submitted in the same tick join this batch
            batch, rows = [], 0
            while self._pending and (not batch or rows + self._pending[0][0].n <= self.max_batch_rows):
                batch.append(self._pending.pop(0))
                rows += batch[-1][0].n
            if self._pending:
                self._wake.set()
            groups: dict[tuple, list] = {}
            for req, fut in batch:
                groups.setdefault(req.batch_key(), []).append((req, fut))
            for items in groups.values():
                req0 = items[0][0]
                try:
                    pictures = {"images": [list(r.images) for r, _ in items]} if any(r.images for r, _ in items) else {}
                    async with self._lock:
                        results = await asyncio.to_thread(
                            self.inner.generate,
                            [r.prompt_token_ids for r, _ in items],
                            req0.n,
                            max_new_tokens=req0.max_tokens,
                            temperature=req0.temperature,
                            stop_token_ids=set(req0.stop_token_ids),
                            greedy=req0.greedy,
                            **pictures,
                        )
                except Exception as exc:  # noqa: BLE001 - every waiter gets the engine's failure
                    for _, fut in items:
                        if not fut.done():
                            fut.set_exception(exc)
                    raise
                for (req, fut), completions in zip(items, results):
                    if fut.done():
                        continue
                    if req.request_id in self._aborted:
                        self._aborted.discard(req.request_id)
                        fut.set_result(_aborted(req, self.version))
                    else:
                        fut.set_result(completions)


def _aborted(req: SamplingRequest, version: int) -> list[Completion]:
    return [Completion([], [], "abort", version) for _ in range(req.n)]
