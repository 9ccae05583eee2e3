"""LoRA adapters as the learner publishes them, read by the rollout side.

A policy version trained with ``learner.lora`` is published as its adapter alone: a safetensors
object holding PEFT's tensors (``base_model.model.<module>.lora_A.weight`` of shape (rank, in),
``...lora_B.weight`` of shape (out, rank)) whose metadata carries, under ``conveyor.lora``, the
adapter's config as JSON (``rank``, ``alpha``, ``target_modules``). A few megabytes per version
instead of the model. Readers: the vLLM engine serves it as a LoRA adapter (PEFT's directory
layout, written by :func:`write_peft_dir`); the reference engine and ``runs export-model`` merge
it into the base model's weights (:func:`merged`): ``W = W0 + alpha / rank * B @ A``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

METADATA_KEY = "conveyor.lora"
PREFIX = "base_model.model."


def metadata(rank: int, alpha: float, target_modules: list[str]) -> dict[str, str]:
    """The safetensors metadata of a published adapter."""
    return {METADATA_KEY: json.dumps({"rank": rank, "alpha": alpha, "target_modules": list(target_modules)})}


def adapter_config(data: bytes) -> dict | None:
    """The adapter config of a published blob (reads only its header); None for full weights."""
    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except (struct.error, ValueError, UnicodeDecodeError, AttributeError):
        return None  # not safetensors: the full-weights path refuses it with its own reason
    raw = meta.get(METADATA_KEY)
    return json.loads(raw) if raw else None


def merged(base: dict, data: bytes) -> dict:
    """``base`` (the model's own state dict, by its names) with the adapter in ``data`` merged in:
    every tensor of ``base``, the adapted ones replaced. Raises ValueError for an adapter whose
    modules or shapes do not fit ``base``."""
    from safetensors.torch import load

    config = adapter_config(data)
    if config is None:
        raise ValueError("not an adapter (no conveyor.lora metadata)")
    scale = float(config["alpha"]) / int(config["rank"])
    tensors = load(data)
    out = dict(base)
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[len(PREFIX) : -len(".lora_A.weight")] if name.startswith(PREFIX) else None
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        target = f"{module}.weight"
        if module is None or b is None or target not in base:
            raise ValueError(f"adapter tensor {name} has no module of the model to adapt")
        w = base[target]
        if b.shape[0] != w.shape[0] or a.shape[1] != w.shape[1] or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter of {module}: {tuple(b.shape)} @ {tuple(a.shape)} does not fit {tuple(w.shape)}")
        out[target] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def base_weights(model_dir: Path) -> dict:
    """The model directory's own weights (every adapter applies to these), by their names."""
    from safetensors.torch import load_file

    state: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(f))
    if not state:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return state


def write_peft_dir(directory: Path, data: bytes, base_model: str) -> Path:
    """The adapter in PEFT's directory layout (``adapter_config.json``, ``adapter_model.safetensors``),
    as vLLM's LoRA loader reads it."""
    config = adapter_config(data)
    if config is None:
        raise ValueError("not an adapter (no conveyor.lora metadata)")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_model.safetensors").write_bytes(data)
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": config["rank"],
        "lora_alpha": config["alpha"], "target_modules": config["target_modules"], "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None,
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(peft_config))
    return directory
