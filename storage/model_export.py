"""A run's policy as a complete Hugging Face model directory that transformers and vLLM load.

The learner publishes bare weights (``runs/<run>/weights/v<N>/model.safetensors``, the tensors a
Hugging Face checkpoint stores). An export joins one version's weights with the model's other
files (config, tokenizer, chat template, generation config): those the learner stored under
``runs/<run>/model/`` when the run started, or those of ``base`` (the model the run started from)
for a run that has none. The weights are loaded through transformers and saved again in the
requested dtype, so what is written is what ``AutoModelForCausalLM.from_pretrained`` reads
(``AutoModelForImageTextToText`` for a vision-language model, exported with its image processor).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from conveyor import keys
from conveyor.objectstore import ObjectStore

# The files of a Hugging Face model directory besides its weights.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "preprocessor_config.json",  # a vision-language model's image processor
    "processor_config.json",
)
DTYPES = ("auto", "float32", "bfloat16", "float16")


class ExportError(ValueError):
    """The export cannot be made (no such version, no config or tokenizer to go with the weights)."""


def published_versions(store: ObjectStore, run_id: str) -> list[int]:
    return sorted(v for i in store.list(keys.weights_prefix(run_id)) if (v := keys.weights_version(i.key)) is not None)


def store_model_files(store: ObjectStore, run_id: str, model_dir: Path) -> list[str]:
    """Put ``model_dir``'s files besides its weights under ``runs/<run>/model/`` (the learner does
    at start), so the run's versions export without the original directory."""
    written = []
    for name in MODEL_FILES:
        path = Path(model_dir, name)
        if path.is_file():
            store.put(keys.model_file_key(run_id, name), path.read_bytes())
            written.append(name)
    return written


STAGES = 4
"""What ``export_model`` reports: model files, weights fetched, loaded in the dtype asked, written."""


def export_model(
    store: ObjectStore,
    run_id: str,
    out: Path,
    *,
    version: int | None = None,
    base: Path | None = None,
    dtype: str = "auto",
    on_stage=None,
) -> dict:
    """Write version ``version`` (default: the newest) of ``run_id``'s policy to ``out``.

    ``dtype`` ``auto`` keeps the config's ``torch_dtype`` (the dtype the model was trained from).
    ``on_stage(1, status=...)`` after each of the :data:`STAGES` (the CLI's progress: a large model's
    weights take minutes to fetch and write). Returns what was written: version, dtype, files."""
    on_stage = on_stage or (lambda *_, **__: None)
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    versions = published_versions(store, run_id)
    if not versions:
        raise ExportError(f"run {run_id!r} has no published weights in the object store")
    version = versions[-1] if version is None else version
    if version not in versions:
        raise ExportError(f"run {run_id!r} has no version {version} (published: {versions[0]}..{versions[-1]})")
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from conveyor.vision import is_vision_model

    with tempfile.TemporaryDirectory(prefix="conveyor-export-") as tmp:
        staged = Path(tmp)
        stored = {i.key.rsplit("/", 1)[1] for i in store.list(keys.model_files_prefix(run_id))}
        for name in MODEL_FILES:
            if name in stored:
                (staged / name).write_bytes(store.get(keys.model_file_key(run_id, name)))
            elif base is not None and Path(base, name).is_file():
                shutil.copyfile(Path(base, name), staged / name)
        if not (staged / "config.json").is_file():
            raise ExportError(
                f"run {run_id!r} stored no model config (runs/{run_id}/model/): pass the model it started from as base"
            )
        if not any((staged / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise ExportError(
                f"run {run_id!r} stored no tokenizer (runs/{run_id}/model/): pass the model it started from as base"
            )
        on_stage(1, status=f"config and tokenizer of {run_id}")
        store.get_file(keys.weights_key(run_id, version), staged / "model.safetensors")
        _merge_if_adapter(staged / "model.safetensors", base, run_id, version)
        on_stage(1, status=f"weights v{version} fetched")
        auto = AutoModelForImageTextToText if is_vision_model(staged) else AutoModelForCausalLM
        model = auto.from_pretrained(staged, dtype="auto" if dtype == "auto" else getattr(torch, dtype))
        on_stage(1, status=f"loaded as {str(model.dtype).removeprefix('torch.')}")
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        for name in MODEL_FILES:
            if name not in ("config.json", "generation_config.json") and (staged / name).is_file():
                shutil.copyfile(staged / name, out / name)
        on_stage(1, status=f"written to {out}")
    return {
        "run_id": run_id,
        "version": version,
        "dtype": str(model.dtype).removeprefix("torch."),
        "files": sorted(p.name for p in out.iterdir()),
    }


def _merge_if_adapter(weights: Path, base: Path | None, run_id: str, version: int) -> None:
    """A LoRA version (``learner.lora``) is its adapter alone: merged into the base model's weights,
    so the export is a complete model."""
    from safetensors.torch import save_file

    from conveyor import adapters

    data = weights.read_bytes()
    if adapters.adapter_config(data) is None:
        return
    if base is None:
        raise ExportError(
            f"version {version} of {run_id!r} is a LoRA adapter: pass the model it started from (--base-model) to merge it into"
        )
    try:
        state = adapters.merged(adapters.base_weights(base), data)
    except (ValueError, FileNotFoundError) as exc:
        raise ExportError(f"version {version} of {run_id!r}: the adapter does not fit {base}: {exc}") from None
    save_file({k: v.contiguous() for k, v in state.items()}, str(weights))
