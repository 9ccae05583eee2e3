"""The learner as a run config describes it: ``conveyor serve learner``, the demo and the tests
build it here."""

from __future__ import annotations

from pathlib import Path

from conveyor.config import RunConfig
from conveyor.messaging import claim_check_for
from conveyor.objectstore import ObjectStore
from conveyor.topics import Topics
from conveyor.tracking import open_tracker
from conveyor.transport.base import Transport
from learner.recipe import GRPOLearner


def load_policy(model_dir: Path, cfg: RunConfig, ranks=None):
    """``(policy, tokenizer)`` from a model directory as the learner trains it: fp32 master weights
    (on the GPU when there is one; the step autocasts to bf16), activation checkpointing when the
    config asks, FSDP2-sharded over ``ranks`` when there are several."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from conveyor.vision import is_vision_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    check_attn_implementation(cfg.learner.attn_implementation)
    auto = AutoModelForImageTextToText if is_vision_model(model_dir) else AutoModelForCausalLM
    policy = auto.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=cfg.learner.attn_implementation)
    if cfg.learner.lora is not None:
        policy = with_adapter(policy, cfg, vision=is_vision_model(model_dir), ranks=ranks)
    if cfg.learner.context_parallel > 1:
        use_ring_attention(policy)
    if torch.cuda.is_available():
        policy = policy.cuda()
    if cfg.learner.activation_checkpointing:
        policy.gradient_checkpointing_enable()
    if ranks is not None:
        from learner.distributed import shard

        policy = shard(policy, mixed_precision=torch.cuda.is_available())
    return policy, tok


def vision_of(model_dir: Path, cfg: RunConfig):
    """A vision-language model's prompting (``conveyor.vision.VisionPrompting``: its image
    processor), None for a text model; ConfigError, naming the field, for what it cannot run."""
    from conveyor.errors import ConfigError
    from conveyor.vision import VisionModelError, VisionPrompting, is_vision_model

    if not is_vision_model(model_dir):
        return None
    if cfg.learner.context_parallel > 1:
        raise ConfigError("learner.context_parallel: a vision-language model trains its sequences whole, on one process")
    try:
        return VisionPrompting(model_dir)
    except VisionModelError as exc:
        raise ConfigError(f"model: {exc}") from None


def use_ring_attention(model) -> None:
    """Switch ``model`` to ring attention (``learner/ring_attention.py``) for context parallelism, or
    refuse at start, naming the field, a model whose attention it would not compute exactly."""
    from conveyor.errors import ConfigError
    from learner.ring_attention import register

    config = model.config
    why = None
    if not getattr(model, "_supports_attention_backend", False):
        why = f"{type(model).__name__} does not route its attention through transformers' attention interface"
    elif getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        why = "its layers use sliding-window attention"
    elif getattr(config, "attn_logit_softcapping", None):
        why = "it soft-caps attention logits"
    elif getattr(config, "attention_dropout", 0.0):
        why = "it has attention dropout"
    if why:
        raise ConfigError(f"learner.context_parallel: ring attention cannot split this model: {why}")
    model.set_attn_implementation(register())


def with_adapter(policy, cfg: RunConfig, *, vision: bool, ranks):
    """``policy`` with a LoRA adapter (PEFT) on ``learner.lora``'s modules: only the adapter trains."""
    from conveyor.errors import ConfigError

    if vision or ranks is not None:
        raise ConfigError("learner.lora: adapters train on one learner process with a text model (not a vision-language "
                          "model, not several ranks)")  # fmt: skip
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ConfigError(f"learner.lora needs the peft package (pip install -e '.[train]'): {exc}") from None
    lora = cfg.learner.lora
    names = {n.rsplit(".", 1)[-1] for n, _ in policy.named_modules()}
    missing = sorted(set(lora.target_modules) - names)
    if missing:
        raise ConfigError(f"learner.lora.target_modules: {missing} are not modules of this model")
    peft_cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                          lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(policy, peft_cfg)


def check_attn_implementation(name: str) -> None:
    """Refuse at start an attention kernel this machine cannot run (rather than fail inside the first step)."""
    import importlib.util

    import torch

    from conveyor.errors import ConfigError

    if name == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("learner.attn_implementation: flash_attention_2 needs the flash-attn package "
                              "(pip install -e '.[flash-attn]'); sdpa needs nothing")  # fmt: skip
        if not torch.cuda.is_available():
            raise ConfigError("learner.attn_implementation: flash_attention_2 runs on a CUDA GPU only; sdpa runs anywhere")
    if name == "flex_attention" and not torch.cuda.is_available():
        raise ConfigError("learner.attn_implementation: flex_attention trains on a CUDA GPU only (PyTorch has no "
                          "FlexAttention backward on CPU); sdpa runs anywhere")  # fmt: skip


def admission_bound(cfg: RunConfig) -> int:
    """The rollout workers' admission bound: ``max_lag + 1`` batches of samples."""
    return (cfg.learner.max_lag + 1) * cfg.learner.batch_groups * cfg.producer.group_size


def build(
    cfg: RunConfig,
    transport: Transport | None,
    topics: Topics,
    store: ObjectStore | None,
    *,
    model,
    pad_id: int,
    run_dir: Path,
    ranks=None,
    wait_for_admitted: bool = True,
    vision=None,
) -> GRPOLearner:
    """The learner of ``model`` (loaded by :func:`load_policy`). ``wait_for_admitted``: a batch
    also waits for the oldest attempt the workers started that has not arrived
    (``learner/admitted_window.py``); ``vision``: a vision-language model's :func:`vision_of`.
    Raises ValueError for settings that cannot be combined."""
    return GRPOLearner(
        transport,
        topics,
        model,
        pad_id,
        store,
        cfg.learner,
        run_dir=run_dir,
        admission_bound=admission_bound(cfg) if wait_for_admitted else None,
        ranks=ranks,
        claim_check=claim_check_for(cfg, store),
        # named after the run (a restarted learner logs into a run of the same name), with the whole
        # config, secrets masked
        tracker=open_tracker(cfg.tracking, run_dir, cfg.run_id, cfg.model_dump(mode="json")),
        vision=vision,
    )
