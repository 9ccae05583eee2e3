"""The trajectory lake: scored rollouts as Parquet in the object store.

Key layout (all under one run)::

    runs/<run>/lake/policy_version=<v>/part-<h>.parquet   rows of one flush with that (oldest) version
    runs/<run>/lake/_manifest/part-<h>.json                the part's key, size, sha256 and column stats
    runs/<run>/meta/run.json                               run metadata (config, commit, created)
    runs/<run>/weights/v<version>/model.safetensors        policy versions (the learner)

``<h>`` is the sha256 of the part's sorted rollout ids: the same batch
written twice has the same name, and ``put_if_absent`` keeps one object.
A part is written before its manifest entry; the reader treats the parts as
the source of truth and uses manifest stats only to skip parts.

Columns are typed (ids, run, task, policy versions, reward, verdict, token
ids as ``list<int32>``, logprobs as ``list<float32>``, the loss mask as
``binary`` (one 0/1 byte per completion token), texts, timings. The lists
are non-nullable, with non-nullable elements. Older parts hold nullable
lists and the loss mask as ``list<uint8>`` (a sixth of the decode time
for one byte per token); they read the same;
nested structures (version segments, turns, task, feedback, details) are
JSON strings. A row converts back to the exact
``ScoredRollout`` it came from (:func:`rows_from_table`).

Readers deduplicate by ``rollout_id``: a sink killed between writing a part
and committing its offsets rewrites those rows, possibly grouped into a
different part, and the reader returns each rollout once (first part in
key order wins).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from conveyor.objectstore import ObjectNotFound, ObjectStore, sha256_hex


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


# --------------------------------------------------------------------------
# writing


@dataclass(frozen=True)
class PartInfo:
    key: str
    rows: int
    size: int
    sha256: str
    policy_version_min: int
    policy_version_max: int
    reward_min: float
    reward_max: float
    scored_at_min: float
    scored_at_max: float
    verdicts: dict[str, int]


def write_parts(store: ObjectStore, run_id: str, rows: Sequence[ScoredRollout]) -> list[PartInfo]:
    """One part per oldest policy version, rows sorted by rollout id, one row per id.

    Idempotent: the same rows give the same keys and bytes; an existing part is kept.
    Raises the store's errors (``ObjectStoreUnavailable`` while S3 is down)."""
    unique = {r.rollout_id: r for r in rows}
    by_version: dict[int, list[ScoredRollout]] = {}
    for r in unique.values():
        by_version.setdefault(r.rollout.min_policy_version, []).append(r)
    parts = []
    for version, group in sorted(by_version.items()):
        group.sort(key=lambda r: r.rollout_id)
        key = part_key(run_id, version, [r.rollout_id for r in group])
        data = parquet_bytes(group)
        digest = sha256_hex(data)
        store.put_if_absent(key, data, sha256=digest)
        verdicts: dict[str, int] = {}
        for r in group:
            verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
        info = PartInfo(
            key=key,
            rows=len(group),
            size=len(data),
            sha256=digest,
            policy_version_min=version,
            policy_version_max=max(max((s.policy_version for s in r.rollout.version_segments), default=0) for r in group),
            reward_min=min(r.reward for r in group),
            reward_max=max(r.reward for r in group),
            scored_at_min=min(r.scored_at for r in group),
            scored_at_max=max(r.scored_at for r in group),
            verdicts=verdicts,
        )
        store.put(keys.lake_manifest_key(key), json.dumps(info.__dict__, sort_keys=True).encode())
        parts.append(info)
    return parts


# --------------------------------------------------------------------------
# reading


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


class LakeReader:
    """Reads a run's lake: the same filter yields the same rollouts in the same order
    (parts by (policy version, key), rows by rollout id), each rollout once."""

    def __init__(self, store: ObjectStore, run_id: str, *, prefetch: int = 4) -> None:
        self.store = store
        self.run_id = run_id
        self.prefetch = prefetch

    def manifest(self) -> dict[str, dict]:
        out = {}
        for info in self.store.list(keys.lake_manifest_prefix(self.run_id)):
            try:
                m = json.loads(self.store.get(info.key))
            except (ObjectNotFound, ValueError):
                continue
            out[m["key"]] = m
        return out

    def parts(self, flt: LakeFilter | None = None) -> list[str]:
        """The parts that may hold rows the filter admits, in replay order. The policy version
        is in each part's key; the manifest (one GET per part) is read only when the filter
        bounds reward, time or verdict."""
        flt = flt or LakeFilter()
        by_stats = any(b is not None for b in (flt.reward_min, flt.reward_max, flt.scored_after, flt.scored_before, flt.verdicts))
        manifest = self.manifest() if by_stats else {}
        keep = []
        for info in self.store.list(keys.lake_prefix(self.run_id) + "policy_version="):
            if not info.key.endswith(".parquet"):
                continue
            v = keys.lake_version(info.key)
            if (flt.policy_version_min is not None and v < flt.policy_version_min) or (
                flt.policy_version_max is not None and v > flt.policy_version_max
            ):
                continue
            m = manifest.get(info.key)
            if m is not None and not flt.admits_part(m):  # a part without a manifest entry is read
                continue
            keep.append(info.key)
        return sorted(keep, key=lambda k: (keys.lake_version(k), k))

    def _load(self, key: str) -> list[ScoredRollout]:
        # BufferReader: Arrow reads the bytes in place, without a Python file object (and the GIL).
        return rows_from_table(pq.read_table(pa.BufferReader(self.store.get(key))))

    def iter(self, flt: LakeFilter | None = None) -> Iterator[ScoredRollout]:
        flt = flt or LakeFilter()
        keys = self.parts(flt)
        seen: set[str] = set()
        with ThreadPoolExecutor(max(1, self.prefetch)) as pool:
            futures = [pool.submit(self._load, k) for k in keys[: self.prefetch]]
            for i in range(len(keys)):
                rows = futures[i].result()
                if i + self.prefetch < len(keys):
                    futures.append(pool.submit(self._load, keys[i + self.prefetch]))
                futures[i] = None  # type: ignore[call-overload]
                for s in rows:
                    if s.rollout_id in seen or not flt.admits(s):
                        continue
                    seen.add(s.rollout_id)
                    yield s

    def iter_tables(self, flt: LakeFilter | None = None) -> Iterator[pa.Table]:
        """The same rows as :meth:`iter`, in the same order, as Arrow tables (one per part):
        no Python object per row, for bulk readers (exports, dataset builders)."""
        import pyarrow.compute as pc

        flt = flt or LakeFilter()
        keys = self.parts(flt)
        seen: set[str] = set()

        def load(key: str) -> pa.Table:
            return pq.read_table(pa.BufferReader(self.store.get(key)), use_threads=False)

        with ThreadPoolExecutor(max(1, self.prefetch)) as pool:
            for table in pool.map(load, keys):  # map keeps order; up to `prefetch` parts in flight
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
                if mask is not None:
                    table = table.filter(mask)
                # Each rollout once, first occurrence kept, as `iter`: a part's own ids against the
                # set of those already yielded (work per part, not per rollout read so far).
                keep = []
                for i, rid in enumerate(table["rollout_id"].to_pylist()):
                    if rid not in seen:
                        seen.add(rid)
                        keep.append(i)
                if len(keep) < table.num_rows:
                    table = table.take(keep)
                if table.num_rows:
                    yield table

    def stats(self) -> dict:
        manifest = self.manifest()
        rows = sum(m["rows"] for m in manifest.values())
        verdicts: dict[str, int] = {}
        for m in manifest.values():
            for k, v in m["verdicts"].items():
                verdicts[k] = verdicts.get(k, 0) + v
        versions = [m["policy_version_min"] for m in manifest.values()]
        return {
            "parts": len(manifest),
            "rows": rows,
            "bytes": sum(m["size"] for m in manifest.values()),
            "policy_versions": [min(versions), max(versions)] if versions else None,
            "verdicts": verdicts,
        }
