"""``--model`` on every command: a local Hugging Face directory or a Hub id (``Qwen/Qwen2.5-0.5B``)
resolved through the local Hub cache; one that cannot be had exits 2 naming it."""

from __future__ import annotations

from pathlib import Path

from launch.cli.exits import fail

HELP = "Hugging Face model: a local directory, or a Hub id resolved through the local cache (HF_HUB_OFFLINE=1 works)."


def resolved(name: str | Path) -> Path:
    from conveyor.hf import ModelNotFound, resolve_model

    try:
        return resolve_model(name)
    except ModelNotFound as exc:
        fail(f"--model: {exc}")
