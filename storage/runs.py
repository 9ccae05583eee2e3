"""Run metadata in the object store, so a run can be inspected after the fact.

runs/<run>/meta/run.json        config, code commit, host, start time (written at start)
runs/<run>/meta/summary.json    end figures (written at the end)
runs/<run>/meta/<file>          metrics.jsonl, eval.jsonl, report.png, ...
runs/<run>/rollouts/...         trajectories: the rollouts table (storage/table.py)
runs/<run>/weights/v<N>/...     policy versions (the learner)
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path

from conveyor import keys
from conveyor.objectstore import ObjectNotFound, ObjectStore
from storage.lake import LakeReader


def code_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_run_meta(store: ObjectStore, run_id: str, config: dict, **extra) -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("conveyor")
    except PackageNotFoundError:
        ver = None
    meta = {
        "run_id": run_id,
        "created_at": time.time(),
        "commit": code_commit(),
        "conveyor_version": ver,
        "host": platform.node(),
        "config": config,
        **extra,
    }
    store.put(keys.meta_key(run_id, "run.json"), json.dumps(meta, indent=2, default=str).encode())


def upload_run_files(store: ObjectStore, run_id: str, files: list[Path]) -> list[str]:
    written = []
    for f in files:
        if f.exists():
            key = keys.meta_key(run_id, f.name)
            store.put_file(key, f)
            written.append(key)
    return written


def list_runs(store: ObjectStore) -> list[dict]:
    runs: dict[str, dict] = {}
    for info in store.list(keys.RUNS):
        run_id = keys.run_of(info.key)
        if run_id is None:
            continue
        run = runs.setdefault(run_id, {"run_id": run_id, "objects": 0, "bytes": 0, "last_modified": 0.0})
        run["objects"] += 1
        run["bytes"] += info.size
        if info.key.endswith("/meta/run.json"):
            try:
                run["created_at"] = json.loads(store.get(info.key)).get("created_at")
            except (ObjectNotFound, ValueError):
                pass
    return sorted(runs.values(), key=lambda r: (r.get("created_at") or 0, r["run_id"]))


def show_run(store: ObjectStore, run_id: str) -> dict:
    def get_json(name: str):
        try:
            return json.loads(store.get(keys.meta_key(run_id, name)))
        except (ObjectNotFound, ValueError):
            return None

    weights = sorted({v for i in store.list(keys.weights_prefix(run_id)) if (v := keys.weights_version(i.key)) is not None})
    meta_files = sorted(i.key.rsplit("/", 1)[1] for i in store.list(keys.meta_prefix(run_id)))
    return {
        "run_id": run_id,
        "meta": get_json("run.json"),
        "summary": get_json("summary.json"),
        "lake": LakeReader(store, run_id).stats(),
        "weight_versions": weights,
        "files": meta_files,
    }
