"""The lake's columns: the typed Arrow schema, a ScoredRollout's row and back, Parquet bytes, filters.

Columns are typed (ids, run, task, policy versions, reward, verdict, token
ids as ``list<int32>``, logprobs as ``list<float32>``, the loss mask as
``binary`` (one 0/1 byte per completion token), texts, timings. The lists
are non-nullable, with non-nullable elements. Older parts hold nullable
lists and the loss mask as ``list<uint8>`` (a sixth of the decode time
for one byte per token); they read the same;
nested structures (version segments, turns, task, feedback, details) are
JSON strings. A row converts back to the exact
``ScoredRollout`` it came from (:func:`rows_from_table`).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from conveyor import keys
from conveyor.contracts import (
    Feedback,
    Rollout,
    ScoredRollout,
    Task,
    Timings,
    Turn,
    VersionSegment,
)


def _required_list(value_type: pa.DataType) -> pa.DataType:
    """A list column that is never null and holds no nulls: Parquet stores it with one
    definition level instead of three, which reads a fifth faster (docs/BENCHMARKS.md)."""
    return pa.list_(pa.field("element", value_type, nullable=False))


SCHEMA = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("run_id", pa.string()),
        ("task_id", pa.string()),
        ("sample_index", pa.int32()),
        ("attempt", pa.int32()),
        ("group_size", pa.int32()),
        ("policy_version_min", pa.int32()),
        ("policy_version_max", pa.int32()),
        ("reward", pa.float64()),
        ("verdict", pa.string()),
        ("finish_reason", pa.string()),
        ("split", pa.string()),
        ("prompt_text", pa.string()),
        ("completion_text", pa.string()),
        pa.field("prompt_token_ids", _required_list(pa.int32()), nullable=False),
        pa.field("completion_token_ids", _required_list(pa.int32()), nullable=False),
        pa.field("behaviour_logprobs", _required_list(pa.float32()), nullable=False),
        pa.field("loss_mask", pa.binary(), nullable=False),  # one uint8 per completion token
        ("version_segments_json", pa.string()),
        ("turns_json", pa.string()),
        ("task_json", pa.string()),
        ("feedback_json", pa.string()),
        ("details_json", pa.string()),
        ("task_received_at", pa.float64()),
        ("generation_started_at", pa.float64()),
        ("generation_finished_at", pa.float64()),
        ("rollout_created_at", pa.float64()),
        ("scored_at", pa.float64()),
        ("created_at", pa.float64()),
        ("schema_version", pa.int16()),
    ]
)
_json = msgspec.json.Encoder()
_DICT_COLUMNS = [f.name for f in SCHEMA if pa.types.is_string(f.type)]
_STAT_COLUMNS = ["rollout_id", "policy_version_min", "policy_version_max", "reward", "verdict", "scored_at"]


def part_key(run_id: str, policy_version: int, rollout_ids: Sequence[str]) -> str:
    """A part's key names its rows: the same rollouts flushed twice land on the same key."""
    digest = hashlib.sha256("\n".join(sorted(rollout_ids)).encode()).hexdigest()[:32]
    return keys.lake_part_key(run_id, policy_version, digest)


def _offsets(views: list[memoryview]) -> np.ndarray:
    offsets = np.zeros(len(views) + 1, dtype=np.int32)
    np.cumsum(np.fromiter((len(v) for v in views), dtype=np.int32, count=len(views)), out=offsets[1:])
    return offsets


def _list_array(views: list[memoryview], dtype, arrow_type: pa.DataType) -> pa.ListArray:
    values = np.frombuffer(b"".join(views), dtype=dtype) if views else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(_offsets(views)), pa.array(values, type=arrow_type), type=_required_list(arrow_type))


def _binary_array(views: list[memoryview]) -> pa.BinaryArray:
    return pa.Array.from_buffers(pa.binary(), len(views), [None, pa.py_buffer(_offsets(views)), pa.py_buffer(b"".join(views))])


def table_from_rows(rows: Sequence[ScoredRollout]) -> pa.Table:
    rs = [s.rollout for s in rows]
    tasks = [r.task for r in rs]
    cols = {
        "rollout_id": [r.rollout_id for r in rs],
        "run_id": [r.run_id for r in rs],
        "task_id": [r.task_id for r in rs],
        "sample_index": [r.sample_index for r in rs],
        "attempt": [r.attempt for r in rs],
        "group_size": [r.group_size for r in rs],
        "policy_version_min": [r.min_policy_version for r in rs],
        "policy_version_max": [max((seg.policy_version for seg in r.version_segments), default=0) for r in rs],
        "reward": [s.reward for s in rows],
        "verdict": [s.verdict for s in rows],
        "finish_reason": [r.finish_reason for r in rs],
        "split": [t.split if t else None for t in tasks],
        "prompt_text": [(t.prompt if t.prompt is not None else _json.encode(t.messages).decode()) if t else None for t in tasks],
        "completion_text": [s.completion_text for s in rows],
        "version_segments_json": [_json.encode(r.version_segments).decode() for r in rs],
        "turns_json": [_json.encode(r.turns).decode() if r.turns else None for r in rs],
        "task_json": [_json.encode(t).decode() if t else None for t in tasks],
        "feedback_json": [_json.encode(s.feedback).decode() if s.feedback else None for s in rows],
        "details_json": [_json.encode(s.details).decode() if s.details else None for s in rows],
        "task_received_at": [r.timings.task_received_at for r in rs],
        "generation_started_at": [r.timings.generation_started_at for r in rs],
        "generation_finished_at": [r.timings.generation_finished_at for r in rs],
        "rollout_created_at": [r.created_at for r in rs],
        "scored_at": [s.scored_at for s in rows],
        "created_at": [s.created_at for s in rows],
        "schema_version": [s.schema_version for s in rows],
    }
    arrays = []
    for field in SCHEMA:
        if field.name == "prompt_token_ids":
            arrays.append(_list_array([r.prompt_token_ids for r in rs], np.int32, pa.int32()))
        elif field.name == "completion_token_ids":
            arrays.append(_list_array([r.completion_token_ids for r in rs], np.int32, pa.int32()))
        elif field.name == "behaviour_logprobs":
            arrays.append(_list_array([r.behaviour_logprobs for r in rs], np.float32, pa.float32()))
        elif field.name == "loss_mask":
            arrays.append(_binary_array([r.loss_mask for r in rs]))
        else:
            arrays.append(pa.array(cols[field.name], type=field.type))
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


COMPRESSION = "zstd"
"""Parquet codec of new parts (parts written with any codec stay readable). lz4 decodes the
token and logprob lists 2.4x faster than zstd for 30% more bytes: replay rose from 0.25 to
0.30-0.31 of raw GETs, but the sink, which writes those bytes to S3 on the same cores, fell by
a fifth (docs/BENCHMARKS.md). The sink runs all the time, so zstd stays the default."""


def parquet_bytes(rows: Sequence[ScoredRollout]) -> bytes:
    """Deterministic for the same rows in the same order (no timestamps in the file)."""
    buf = io.BytesIO()
    # Dictionary encoding only pays for the string columns (run, task, verdict, repeated JSON);
    # on token arrays it costs 4x the write time for nothing.
    pq.write_table(table_from_rows(rows), buf, compression=COMPRESSION, use_dictionary=_DICT_COLUMNS,
                   write_statistics=_STAT_COLUMNS)  # fmt: skip
    return buf.getvalue()


def _split_lists(col: pa.ChunkedArray, dtype) -> list[memoryview]:
    """One typed view per row over the column's decoded values, without copying them
    (the views keep the Arrow buffer alive; copying it cost a third of the row build).
    Takes ``list<...>`` columns and ``binary`` ones (one byte per value: the loss mask)."""
    arr = col.combine_chunks()
    if pa.types.is_binary(arr.type):
        _, offsets_buf, data = arr.buffers()
        offsets = np.frombuffer(offsets_buf, np.int32)[arr.offset : arr.offset + len(arr) + 1].tolist()
        values = memoryview(np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8))
    else:
        offsets = arr.offsets.to_numpy().tolist()
        values = memoryview(arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False))
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(arr))]


class _cached:
    """A decoder that decodes each distinct JSON string once (immutable results only)."""

    def __init__(self, dec) -> None:
        self.dec, self.memo = dec, {}

    def decode(self, text: str):
        out = self.memo.get(text)
        if out is None:
            out = self.memo[text] = self.dec.decode(text)
        return out


def conform(table: pa.Table) -> pa.Table:
    """``table`` with every column of :data:`SCHEMA`: a file written before a column was added holds
    nulls there (its own columns are kept as they are, older types included)."""
    missing = [f for f in SCHEMA if f.name not in table.column_names]
    for f in missing:
        table = table.append_column(f.with_nullable(True), pa.nulls(table.num_rows, f.type))
    return table


def rows_from_table(table: pa.Table) -> list[ScoredRollout]:
    """The exact ScoredRollouts a table was written from."""
    n = table.num_rows
    c = {name: table.column(name).to_pylist() for name in table.column_names if not name.endswith("token_ids")
         and name not in ("behaviour_logprobs", "loss_mask")}  # fmt: skip
    prompt_ids = _split_lists(table.column("prompt_token_ids"), np.int32)
    completion_ids = _split_lists(table.column("completion_token_ids"), np.int32)
    logprobs = _split_lists(table.column("behaviour_logprobs"), np.float32)
    masks = _split_lists(table.column("loss_mask"), np.uint8)
    seg_dec = _cached(msgspec.json.Decoder(list[VersionSegment]))
    turns_dec = msgspec.json.Decoder(list[Turn])
    task_dec = _cached(msgspec.json.Decoder(Task))  # the rows of a group share one task
    fb_dec = msgspec.json.Decoder(Feedback)
    details_dec = msgspec.json.Decoder(dict[str, float])
    out = []
    for i in range(n):
        rollout = Rollout(
            rollout_id=c["rollout_id"][i],
            task_id=c["task_id"][i],
            run_id=c["run_id"][i],
            sample_index=c["sample_index"][i],
            attempt=c["attempt"][i],
            group_size=c["group_size"][i],
            prompt_token_ids=prompt_ids[i],
            completion_token_ids=completion_ids[i],
            behaviour_logprobs=logprobs[i],
            loss_mask=masks[i],
            version_segments=list(seg_dec.decode(c["version_segments_json"][i])),  # own list, shared frozen segments
            turns=turns_dec.decode(c["turns_json"][i]) if c["turns_json"][i] else [],
            finish_reason=c["finish_reason"][i],
            timings=Timings(
                task_received_at=c["task_received_at"][i],
                generation_started_at=c["generation_started_at"][i],
                generation_finished_at=c["generation_finished_at"][i],
            ),
            task=task_dec.decode(c["task_json"][i]) if c["task_json"][i] else None,
            created_at=c["rollout_created_at"][i],
            schema_version=c["schema_version"][i],
        )
        out.append(
            ScoredRollout(
                rollout=rollout,
                reward=c["reward"][i],
                verdict=c["verdict"][i],
                feedback=fb_dec.decode(c["feedback_json"][i]) if c["feedback_json"][i] else None,
                details=details_dec.decode(c["details_json"][i]) if c["details_json"][i] else {},
                scored_at=c["scored_at"][i],
                completion_text=c["completion_text"][i],
                created_at=c["created_at"][i],
                schema_version=c["schema_version"][i],
            )
        )
    return out


@dataclass(frozen=True)
class LakeFilter:
    """Which rollouts to read; every bound is inclusive, None means unbounded."""

    policy_version_min: int | None = None
    policy_version_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    verdicts: frozenset[str] | None = None
    scored_after: float | None = None
    scored_before: float | None = None

    def admits_part(self, m: dict) -> bool:
        """Whether a part's manifest statistics (reward, time, verdicts) allow a matching row."""

        def overlaps(lo, hi, a, b):
            return (lo is None or b >= lo) and (hi is None or a <= hi)

        return (
            overlaps(self.reward_min, self.reward_max, m["reward_min"], m["reward_max"])
            and overlaps(self.scored_after, self.scored_before, m["scored_at_min"], m["scored_at_max"])
            and (self.verdicts is None or bool(self.verdicts & set(m["verdicts"])))
        )

    def admits(self, s: ScoredRollout) -> bool:
        v = s.rollout.min_policy_version

        def within(lo, hi, x):
            return (lo is None or x >= lo) and (hi is None or x <= hi)

        return (
            within(self.policy_version_min, self.policy_version_max, v)
            and within(self.reward_min, self.reward_max, s.reward)
            and within(self.scored_after, self.scored_before, s.scored_at)
            and (self.verdicts is None or s.verdict in self.verdicts)
        )


def filter_table(table: pa.Table, flt: LakeFilter) -> pa.Table:
    """The rows of ``table`` that ``flt`` admits, in order (vectorised, no Python object per row)."""
    import pyarrow.compute as pc

    mask = None
    for column, lo, hi in (("policy_version_min", flt.policy_version_min, flt.policy_version_max),
                           ("reward", flt.reward_min, flt.reward_max),
                           ("scored_at", flt.scored_after, flt.scored_before)):  # fmt: skip
        for bound, op in ((lo, pc.greater_equal), (hi, pc.less_equal)):
            if bound is not None:
                m = op(table[column], bound)
                mask = m if mask is None else pc.and_(mask, m)
    if flt.verdicts is not None:
        m = pc.is_in(table["verdict"], pa.array(sorted(flt.verdicts), pa.string()))
        mask = m if mask is None else pc.and_(mask, m)
    return table if mask is None else table.filter(mask)
