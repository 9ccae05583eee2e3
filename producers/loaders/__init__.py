"""Task loaders: JSONL and Parquet files in the layouts users already have.

A :class:`FieldMapping` says which source field holds what: the prompt (plain
text or chat messages), the task id, the verifier (kind and payload), the
group size, the split, the metadata to keep. Presets cover common RL data
layouts:

``plain``
    Conveyor's own task layout: ``task_id``, ``prompt`` or ``messages``,
    ``verifier: {kind, data}``, ``group_size``, ``split``, ``priority``,
    ``sampling``, ``metadata``.
``verl``
    veRL Parquet rows: ``prompt`` (chat messages), ``reward_model:
    {ground_truth, style}``, ``data_source``, ``extra_info`` -> a ``math``
    verifier with ``answer`` = ``reward_model.ground_truth``.
``trl``
    TRL records: ``prompt`` (text or messages) and ``solution`` -> ``math``;
    or ``prompt`` and ``tests`` / ``test`` -> ``python_tests``.

Field names are dotted paths into nested objects (``reward_model.ground_truth``).
Chat messages stay messages (``Task.messages``): the rollout worker renders them
with the model's chat template.

A malformed record (bad JSON, missing field, wrong type, empty prompt, unknown
verifier kind, duplicate task id) becomes a :class:`RecordError` naming the
file, the line (JSONL, 1-based) or row (Parquet, 0-based) and the field. With
``on_error="skip"`` it is collected and the record skipped; with ``"fail"``
:class:`RecordRejected` is raised. A bad record never becomes a task.

The package splits the work by job: :mod:`~producers.loaders.mapping` (field
mappings and presets), :mod:`~producers.loaders.formats` (reading JSONL and
Parquet), :mod:`~producers.loaders.records` (a record checked and built into a
task), :mod:`~producers.loaders.errors` and :mod:`~producers.loaders.loader`
(the file-level loop: duplicates, ``on_error``, counts).

Usage::

    result = load_tasks("train.parquet", "run-1", "verl", on_error="skip")
    result.tasks, result.errors

    loader = iter_tasks("big.jsonl", "run-1", "trl", on_error="skip")
    for task in loader:          # streams; loader.errors fills as it goes
        ...
"""

from __future__ import annotations

from producers.loaders.errors import RecordError, RecordRejected, TaskFileError
from producers.loaders.loader import LoadResult, OnError, TaskLoader, iter_tasks, load_tasks
from producers.loaders.mapping import PRESETS, FieldMapping, VerifierRule, load_mapping, resolve_mapping
from producers.loaders.records import build_task, record_hash

__all__ = [
    "PRESETS",
    "FieldMapping",
    "LoadResult",
    "OnError",
    "RecordError",
    "RecordRejected",
    "TaskFileError",
    "TaskLoader",
    "VerifierRule",
    "build_task",
    "iter_tasks",
    "load_mapping",
    "load_tasks",
    "record_hash",
    "resolve_mapping",
]
