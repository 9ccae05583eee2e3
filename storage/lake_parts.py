"""The part-and-manifest layout of runs stored before the rollouts table (``storage/table.py``).

Key layout (under one run)::

    runs/<run>/lake/policy_version=<v>/part-<h>.parquet   rows of one flush with that (oldest) version
    runs/<run>/lake/_manifest/part-<h>.json                the part's key, size, sha256 and column stats

``<h>`` is the sha256 of the part's sorted rollout ids. A sink killed between
writing a part and committing its offsets rewrote those rows, possibly grouped
into another part, so this reader deduplicates by ``rollout_id`` (first part in
key order wins). :class:`storage.lake.LakeReader` reads such a run through
:class:`PartsReader` until ``conveyor runs migrate`` (or the first sink started
on it) copies it into the run's table; :func:`write_parts` stays to write such
lakes in the migration's tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from conveyor import keys
from conveyor.contracts import ScoredRollout
from conveyor.objectstore import ObjectNotFound, ObjectStore, sha256_hex
from storage.columns import LakeFilter, filter_table, parquet_bytes, part_key, rows_from_table

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


class PartsReader:
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
        flt = flt or LakeFilter()
        keys = self.parts(flt)
        seen: set[str] = set()

        def load(key: str) -> pa.Table:
            return pq.read_table(pa.BufferReader(self.store.get(key)), use_threads=False)

        with ThreadPoolExecutor(max(1, self.prefetch)) as pool:
            for table in pool.map(load, keys):  # map keeps order; up to `prefetch` parts in flight
                table = filter_table(table, flt)
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


def has_parts(store: ObjectStore, run_id: str) -> bool:
    """Whether the run holds parts of this layout."""
    return next(iter(store.list(keys.lake_prefix(run_id) + "policy_version=")), None) is not None


def migrate_parts(store: ObjectStore, run_id: str, *, rows_per_file: int = 20_000) -> int:
    """Copy the run's parts into its rollouts table, each rollout once, in one commit; returns the rows
    copied. The parts stay (``conveyor runs migrate --delete-parts`` removes them). A run migrated
    already is left alone (0); a table with other rows is refused."""
    from storage.table import RolloutTable

    table = RolloutTable(store, run_id)
    dt = table.ensure()
    if _has_migration(dt):
        return 0
    if pa.table(dt.get_add_actions()).num_rows:
        raise ValueError(f"run {run_id!r}: its rollouts table already holds rows stored without the older parts; "
                         "copying them in now could store a rollout twice")  # fmt: skip
    files, batch = [], []
    for s in PartsReader(store, run_id).iter():
        batch.append(s)
        if len(batch) >= rows_per_file:
            files.append(table.write_file(batch))
            batch = []
    if batch:
        files.append(table.write_file(batch))
    if files:
        table.commit(files, {}, operation="migrate")
    return sum(f.rows for f in files)


def migrated(store: ObjectStore, run_id: str) -> bool:
    """Whether the run's table holds a migration's commit."""
    from storage.table import RolloutTable

    table = RolloutTable(store, run_id)
    return table.exists() and _has_migration(table.open())


def _has_migration(dt) -> bool:
    return any(c.get("conveyor.operation") == "migrate" for c in dt.history())


def delete_parts(store: ObjectStore, run_id: str) -> int:
    """Remove the older layout's objects; refused unless the run was migrated."""
    if not migrated(store, run_id):
        raise ValueError(f"run {run_id!r} was not migrated: its parts are its only copy")
    n = 0
    for info in list(store.list(keys.lake_prefix(run_id))):
        store.delete(info.key)
        n += 1
    return n
