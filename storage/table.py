"""The rollouts table: a run's scored rollouts as a Delta Lake table in the object store.

Layout (under ``runs/<run>/rollouts/``)::

    _delta_log/00000000000000000000.json   the table's commits (delta-rs writes them)
    part-<uuid>.parquet                     data files, one per sink flush, never overwritten

Every reader that speaks Delta (DuckDB's ``delta_scan``, Polars' ``read_delta``,
pandas through ``deltalake``, Spark) sees exactly the committed rows, each once,
with no help from Conveyor: a data file that is written but not committed is
invisible, and ``vacuum`` removes it later.

Exactly once, tied to Kafka offsets (as kafka-delta-ingest and Spark's Delta
sink do): each commit carries, for every scored-topic partition in the flush,
a Delta application transaction (``txn``) whose version is the next offset to
store. The table, not the consumer group, is the record of what is stored: a
sink that starts reads these versions and seeks there, and a commit whose
partition another writer advanced meanwhile fails with a conflict (delta-rs
checks ``txn`` app ids between concurrent commits), after which the sink
drops the rows already stored and commits the rest. Appends for other
partitions are blind appends: delta-rs retries them on a concurrent commit.

Not partitioned: per-version directories made one small file per version and
flush (hundreds of 40-row files in a 5-minute run). Policy-version pruning
comes from the files' min/max statistics, which ``compact`` makes tight by
sorting on ``policy_version_min`` (Z-order over one column).

The sink writes the Parquet files itself (the measured writer of
``storage/columns.py``, through the object store's client with its retries and
outage handling) and commits them with delta-rs as ``add`` actions carrying
the statistics Delta readers prune with.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
import structlog

from conveyor import keys
from conveyor.contracts import ScoredRollout
from conveyor.errors import RetryableError
from conveyor.objectstore import ObjectNotFound, ObjectStore
from storage.columns import SCHEMA, parquet_bytes, table_from_rows

log = structlog.get_logger(__name__)

STAT_COLUMNS = (
    "rollout_id",
    "task_id",
    "policy_version_min",
    "policy_version_max",
    "reward",
    "verdict",
    "scored_at",
    "created_at",
)
"""Columns whose min/max go into each file's ``add`` action (what readers prune by)."""


class TableUnavailable(RetryableError):
    """The table's storage could not be reached (or answered with a transient error)."""


class ConcurrentCommit(RuntimeError):
    """Another writer committed offsets of the same partition after this one read them."""


def app_id(topic: str, partition: int) -> str:
    """The Delta application-transaction id of one scored-topic partition. Keyed by the source, not the
    consumer group: a second sink group reading the same topic agrees on what is stored."""
    return f"kafka:{topic}:{partition}"


@dataclass(frozen=True)
class DataFile:
    """A written, not yet committed, data file."""

    path: str  # relative to the table root
    rows: int
    size: int
    stats: str  # Delta statistics JSON


def _jsonable(v):
    if isinstance(v, float) and v != v:  # NaN has no JSON form; a missing bound only loses pruning
        return None
    return v


def file_stats(table: pa.Table) -> str:
    mins, maxs, nulls = {}, {}, {}
    for name in STAT_COLUMNS:
        col = table[name]
        nulls[name] = col.null_count
        mm = pc.min_max(col)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if lo is not None:
            mins[name], maxs[name] = _jsonable(lo), _jsonable(hi)
    return json.dumps({"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def _retryable(exc: BaseException) -> bool:
    """delta-rs reports an unreachable or failing store as OSError or a generic DeltaError."""
    from deltalake.exceptions import CommitFailedError, DeltaError, DeltaProtocolError, SchemaMismatchError, TableNotFoundError

    if isinstance(exc, CommitFailedError | DeltaProtocolError | SchemaMismatchError | TableNotFoundError):
        return False
    return isinstance(exc, OSError | DeltaError)


class RolloutTable:
    """One run's rollouts table. Methods block (delta-rs and boto3 calls): services call them in a thread."""

    def __init__(self, store: ObjectStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.prefix = keys.table_prefix(run_id)
        self.uri, self.options = store.table_location(self.prefix)
        self._dt = None

    # -- opening
    def exists(self) -> bool:
        from deltalake import DeltaTable

        try:
            return DeltaTable.is_deltatable(self.uri, self.options)
        except Exception as exc:  # noqa: BLE001 - classified below
            if _retryable(exc):
                raise TableUnavailable(f"rollouts table at {self.uri}: {exc}") from exc
            raise

    def open(self, version: int | None = None, as_of: datetime | None = None):
        """The table at its newest version, a given version, or as of a time (UTC)."""
        from deltalake import DeltaTable

        try:
            dt = DeltaTable(self.uri, version=version, storage_options=self.options)
            if as_of is not None:
                dt.load_as_version(as_of if as_of.tzinfo else as_of.replace(tzinfo=UTC))
            return dt
        except Exception as exc:  # noqa: BLE001 - classified below
            if _retryable(exc):
                raise TableUnavailable(f"rollouts table at {self.uri}: {exc}") from exc
            raise

    def ensure(self):
        """The table, created with the lake's schema if it does not exist (two creators: one wins)."""
        from deltalake import DeltaTable

        if self._dt is not None:
            return self._dt
        try:
            if not self.exists():
                DeltaTable.create(self.uri, SCHEMA, mode="ignore", name=f"rollouts-{self.run_id}", storage_options=self.options)
        except Exception as exc:  # noqa: BLE001
            if _retryable(exc):
                raise TableUnavailable(f"rollouts table at {self.uri}: {exc}") from exc
            if not self.exists():  # lost a creation race if it exists now
                raise
        dt = self.open()
        self._evolve(dt, SCHEMA)
        self._dt = dt
        return dt

    @staticmethod
    def _evolve(dt, schema: pa.Schema) -> None:
        """Add the columns ``schema`` has and the table lacks (nullable: older files hold no values
        for them, and every Delta reader reads those files with nulls there)."""
        from deltalake import Schema

        have = {f.name for f in dt.schema().fields}
        new = [f.with_nullable(True) for f in schema if f.name not in have]
        if new:
            dt.alter.add_columns(Schema.from_arrow(pa.schema(new)).fields)
            log.info("rollouts_table.columns_added", columns=[f.name for f in new])

    # -- writing
    def write_file(self, rows: Sequence[ScoredRollout]) -> DataFile:
        """One data file with ``rows`` (one per rollout id, sorted by policy version then id); not committed.
        Raises the store's errors (``ObjectStoreUnavailable`` while S3 is down)."""
        unique = sorted({r.rollout_id: r for r in rows}.values(), key=lambda r: (r.rollout.min_policy_version, r.rollout_id))
        # A new name per write: a committed file is never overwritten (a rewrite of the same ids may
        # differ, a re-score's timestamps), and a written-then-abandoned one is left to vacuum.
        path = f"part-{uuid.uuid4().hex}.parquet"
        data = parquet_bytes(unique)
        self.store.put_if_absent(self.prefix + path, data)
        return DataFile(path, len(unique), len(data), file_stats(table_from_rows(unique)))

    def committed_offsets(self, app_ids: Iterable[str], *, refresh: bool = True) -> dict[str, int]:
        """The next offset to store per app id, as the table records it (absent: nothing stored)."""
        dt = self.ensure()
        try:
            if refresh:
                dt.update_incremental()
            out = {}
            for a in app_ids:
                v = dt.transaction_version(a)
                if v is not None:
                    out[a] = v
            return out
        except Exception as exc:  # noqa: BLE001
            if _retryable(exc):
                raise TableUnavailable(f"rollouts table at {self.uri}: {exc}") from exc
            raise

    def commit(self, files: Sequence[DataFile], offsets: dict[str, int], *, operation: str = "sink") -> int:
        """Add ``files`` and record ``offsets`` (app id -> next offset) in one atomic commit.

        Raises :class:`ConcurrentCommit` when another writer recorded an offset of the same app id
        since this table's snapshot; returns the new table version."""
        from deltalake import CommitProperties, Transaction
        from deltalake.exceptions import CommitFailedError
        from deltalake.transaction import AddAction

        dt = self.ensure()
        now_ms = int(time.time() * 1000)
        actions = [AddAction(f.path, f.size, {}, now_ms, True, f.stats) for f in files]
        props = CommitProperties(
            app_transactions=[Transaction(a, v, now_ms) for a, v in sorted(offsets.items())],
            custom_metadata={"conveyor.operation": operation, "conveyor.rows": str(sum(f.rows for f in files))},
        )
        try:
            dt.create_write_transaction(actions, "append", SCHEMA, commit_properties=props)
        except CommitFailedError as exc:
            self._dt = None  # reload: the snapshot is behind another writer's commit
            if "concurrent transaction" in str(exc).lower():
                raise ConcurrentCommit(str(exc)) from exc
            raise
        except Exception as exc:  # noqa: BLE001
            self._dt = None
            if _retryable(exc):
                raise TableUnavailable(f"rollouts table at {self.uri}: {exc}") from exc
            raise
        try:  # the snapshot does not advance by itself: the next commit would conflict with this one
            dt.update_incremental()
        except Exception:  # noqa: BLE001 - the commit stands; the next one reloads
            self._dt = None
        return dt.version()

    def append(self, rows: Sequence[ScoredRollout], offsets: dict[str, int] | None = None) -> int:
        """Write and commit ``rows`` as one file (imports, tests, tools); returns the table version."""
        return self.commit([self.write_file(rows)] if rows else [], offsets or {}, operation="append")

    # -- maintenance
    def compact(self, *, target_mb: int = 128) -> dict:
        """Rewrite small files into files of about ``target_mb``, sorted by policy version (Z-order on one
        column): replay reads fewer, larger objects and prunes versions by file statistics."""
        dt = self.ensure()
        return dt.optimize.z_order(["policy_version_min"], target_size=target_mb << 20)

    def lease(self, version: int, ttl_s: float) -> str:
        """Record that a reader needs ``version`` for ``ttl_s`` seconds; returns the lease key."""
        key = f"{keys.table_lease_prefix(self.run_id)}{uuid.uuid4().hex}.json"
        self.store.put(key, json.dumps({"version": version, "expires_at": time.time() + ttl_s}).encode())
        return key

    def leased_versions(self) -> list[int]:
        out = set()
        for info in self.store.list(keys.table_lease_prefix(self.run_id)):
            try:
                lease = json.loads(self.store.get(info.key))
            except (ObjectNotFound, ValueError):
                continue
            if lease.get("expires_at", 0) > time.time():
                out.add(int(lease["version"]))
            else:
                self.store.delete(info.key)
        return sorted(out)

    def vacuum(self, *, retention_hours: int = 168, dry_run: bool = False) -> list[str]:
        """Delete files no version within ``retention_hours`` needs (compaction's inputs), except those of
        versions leased by readers in progress (replay, export); and files never committed (a killed
        sink's) once older than ``max(retention_hours, ORPHAN_MIN_HOURS)``: a running sink's file waits
        between its write and its commit, and must not be taken meanwhile."""
        dt = self.ensure()
        keep = self.leased_versions() or None
        removed = dt.vacuum(retention_hours=retention_hours, dry_run=dry_run, enforce_retention_duration=False,
                            keep_versions=keep)  # fmt: skip
        removed += dt.vacuum(retention_hours=max(retention_hours, ORPHAN_MIN_HOURS), dry_run=dry_run,
                             enforce_retention_duration=False, keep_versions=keep, full=True)  # fmt: skip
        return sorted(set(removed))


ORPHAN_MIN_HOURS = 6
"""Uncommitted files younger than this are never vacuumed (see :meth:`RolloutTable.vacuum`)."""
