"""Field mappings: which source field of a dataset's records holds what.

A :class:`FieldMapping` names the prompt (or chat messages), the task id, the
verifier rules and the optional fields; :data:`PRESETS` holds the layouts of
Conveyor's own files, veRL and TRL. :func:`resolve_mapping` and
:func:`load_mapping` build one from a preset name, a dict of overrides or a
YAML file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from conveyor.errors import ConfigError
from tasks import registry


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VerifierRule(_Model):
    """How to build the verifier of a record.

    The kind is fixed (``kind``) or read from the record (``kind_field``). The
    payload is the object in ``data_field`` (if any), plus ``data`` (payload key
    -> source field, required), plus ``optional_data`` (copied when present),
    plus ``constants``.
    """

    kind: str | None = None
    kind_field: str | None = None
    data_field: str | None = None
    data: dict[str, str] = Field(default_factory=dict)
    optional_data: dict[str, str] = Field(default_factory=dict)
    constants: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_kind(self) -> VerifierRule:
        if (self.kind is None) == (self.kind_field is None):
            raise ValueError("give exactly one of kind (fixed) or kind_field (read from the record)")
        if self.kind is not None and self.kind not in registry.known():
            raise ValueError(f"unknown verifier kind {self.kind!r}; known: {', '.join(registry.known())}")
        return self

    @property
    def required_fields(self) -> list[str]:
        return ([self.kind_field] if self.kind_field else []) + list(self.data.values())

    @property
    def label(self) -> str:
        return self.kind or f"<{self.kind_field}>"


class FieldMapping(_Model):
    """Which source field holds what. Optional fields fall back to their default
    when absent or null; present but invalid, they reject the record."""

    prompt: str | None = "prompt"
    """Field with the prompt: plain text or a list of chat messages {role, content}."""
    messages: str | None = None
    """Field with chat messages, for layouts that keep them apart from ``prompt``."""
    task_id: str | None = None
    """Field with the task id; absent: a stable hash of the record."""
    verifier: list[VerifierRule] = Field(default_factory=list)
    """Tried in order: the first rule whose required fields are all present applies."""
    group_size: str | None = None
    split: str | None = None
    priority: str | None = None
    sampling: str | None = None
    """Field with sampling parameters (an object like SamplingParams)."""
    images: str | None = "images"
    """Field with the record's images (``producers/loaders/images.py``: bytes, paths or
    ``{bytes, path}`` objects, one or a list), placed at the prompt's ``<image>`` markers."""
    tools: str | None = "tools"
    """Field with the functions the model may call (OpenAI's format); absent or null: none."""
    metadata: list[str] = Field(default_factory=list)
    """Fields kept as metadata (non-text values as JSON); absent ones are left out."""
    metadata_from: str | None = None
    """Field with an object merged into the metadata as is."""
    default_group_size: int = Field(1, ge=1)
    default_split: Literal["train", "heldout"] = "train"
    id_prefix: str = "t-"
    """Prefix of hashed task ids."""
    record_source: bool = True
    """Add ``metadata["source"] = "file:line"`` (or ``file:row N``)."""

    @field_validator("verifier", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _has_prompt_and_verifier(self) -> FieldMapping:
        if self.prompt is None and self.messages is None:
            raise ValueError("map prompt or messages to a source field")
        if not self.verifier:
            raise ValueError("give at least one verifier rule")
        return self


PRESETS: dict[str, FieldMapping] = {
    "plain": FieldMapping(
        prompt="prompt",
        messages="messages",
        task_id="task_id",
        verifier=[VerifierRule(kind_field="verifier.kind", data_field="verifier.data")],
        group_size="group_size",
        split="split",
        priority="priority",
        sampling="sampling",
        metadata_from="metadata",
    ),
    "verl": FieldMapping(
        prompt="prompt",
        verifier=[VerifierRule(kind="math", data={"answer": "reward_model.ground_truth"})],
        split="extra_info.split",
        metadata=["data_source", "ability", "extra_info.index", "reward_model.style"],
    ),
    "trl": FieldMapping(
        prompt="prompt",
        task_id="id",
        verifier=[
            VerifierRule(kind="math", data={"answer": "solution"}),
            VerifierRule(kind="python_tests", data={"tests": "tests"}),
            VerifierRule(kind="python_tests", data={"tests": "test"}),
        ],
    ),
}


def resolve_mapping(mapping: FieldMapping | str | dict[str, Any] | None = None, preset: str | None = None) -> FieldMapping:
    """A mapping from a preset name, a :class:`FieldMapping`, or a dict of fields.

    A dict overrides the fields of a preset (its own ``preset`` key, else
    ``preset``, else ``plain``); top-level keys replace the preset's.
    """
    if isinstance(mapping, FieldMapping):
        return mapping
    if isinstance(mapping, str):
        preset, mapping = mapping, None
    overrides = dict(mapping or {})
    name = overrides.pop("preset", None) or preset or "plain"
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    if not overrides:
        return PRESETS[name]
    base = PRESETS[name].model_dump(exclude_unset=False)
    try:
        return FieldMapping(**{**base, **overrides})
    except ValidationError as exc:
        lines = [f"invalid field mapping (preset {name}):"]
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            lines.append(f"  {loc or '<root>'}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None


def load_mapping(path: str | Path, preset: str | None = None) -> FieldMapping:
    """A mapping from a YAML file of :class:`FieldMapping` fields (may name a ``preset``)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read mapping {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"mapping {path}: the top level must be a mapping of fields")
    if data.get("preset") and preset and data["preset"] != preset:
        raise ConfigError(f"mapping {path} names preset {data['preset']!r} but {preset!r} was asked for")
    return resolve_mapping(data, preset)
